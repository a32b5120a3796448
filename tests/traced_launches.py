"""lowering/traced.py's trace of the LoRA, RoPE and padded-attention ops on the NVIDIA launch path, on a machine
without a GPU.

    python tests/traced_launches.py LAYERS [WIDTH]        → one JSON line: what the traced graph holds
    python tests/traced_launches.py LAYERS attention      → the same for RoPE's and the padded attention's calls

A graph of LAYERS LoRA layers' graphopt calls (forward and backward, their input WIDTH features wide, 64 if not
given) and a gated activation's backward each, over a symbolic token count, as Dynamo's dynamic graphs have it, goes
through the post-grad pass that traces their launch functions, then through Inductor's lowering (its IR, without
code generation). Each layer's input and gradient are pointwise values computed in the graph, as a model's are; each
gated backward's gate and up too, which no later node reads but in the last layer (which returns its gate as well).
The launch settings are NVIDIA's, taken on CPU tensors (kernels/layout.py platform); the eager launch that fits the
configs needs a GPU and stands aside, and torch's analysis of which arguments a kernel writes (it compiles the
kernel for the GPU) gives way to the kernels' declared outputs. tests/test_lowering.py runs this in a process of its
own: Triton's interpreter (which the CPU tests use) makes kernels that cannot be traced. The attention graph is
described at attention_calls_over_symbolic_tokens; the flash kernels' inputs are taken as supported on the CPU.
"""

import collections
import json
import sys

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext


def lora_calls_over_symbolic_tokens(layers, width=64):
    """The graph of `layers` LoRA layers' graphopt calls (inputs `width` features wide), forward and backward, over
    a symbolic token count, and its shape environment."""
    import graphopt  # noqa: F401  (the graphopt ops)

    ops = torch.ops.graphopt

    def step(x, w, a, b, grad):
        outputs = []
        for layer in range(layers):
            # values Inductor computes, not yet in buffers of their own when the LoRA ops read them (a light
            # pointwise op: on the CPU Inductor puts a reused exp or sigmoid in a buffer at once, not on the GPU)
            x_layer, grad_layer = x * (layer + 2), grad * (layer + 2)
            xa = ops.lora_down(x_layer, a)
            y = ops.lora_linear(x_layer, w, None, a, b, xa, 2.0, torch.bfloat16)
            outputs += [y, *ops.lora_linear_backward(grad_layer, x_layer, xa, w, a, b, 2.0)]
            gate, up = y * 0.5, y + 1.0
            outputs += ops.gated_activation_backward(grad_layer, gate, up, "silu")
            if layer == layers - 1:
                outputs.append(gate)
        return outputs

    mode, fake = _symbolic()
    x = fake(torch.randn(1, 100, width, dtype=torch.bfloat16), 1)
    w, a = fake(torch.randn(96, width, dtype=torch.bfloat16)), fake(torch.randn(16, width))
    b = fake(torch.randn(96, 16))
    with mode:
        grad = torch.empty(1, x.shape[1], 96, dtype=torch.bfloat16)
        return make_fx(step, tracing_mode="real")(x, w, a, b, grad), mode.shape_env


def attention_calls_over_symbolic_tokens(layers):
    """The graph of `layers` attention layers' RoPE and padded-attention calls (GQA: 4 query heads, 2 key/value
    heads of 64), forward and backward, over a symbolic length of a batch of 2 padded rows, and its shape
    environment. Each layer's q and k, and the gradient of its output, are pointwise values computed in the graph;
    every layer reads the one keep."""
    import graphopt  # noqa: F401  (the graphopt ops)

    ops = torch.ops.graphopt

    def step(q, k, v, keep, cos, sin, grad):
        outputs = []
        for layer in range(layers):
            q_layer, k_layer = ops.rope(q * (layer + 2), k * (layer + 2), cos, sin)
            out, lse = ops.padded_attention(q_layer, k_layer, v, keep, 0.125)
            dq, dk, dv = ops.padded_attention_backward(grad * (layer + 2), q_layer, k_layer, v, keep, out, lse, 0.125)
            outputs += [out, dv, *ops.rope_backward(dq, dk, cos, sin)]
        return outputs

    mode, fake = _symbolic()
    q = fake(torch.randn(2, 4, 100, 64, dtype=torch.bfloat16), 2)
    k, v = (fake(torch.randn(2, 2, 100, 64, dtype=torch.bfloat16), 2) for _ in range(2))
    keep = fake(torch.ones(2, 100, dtype=torch.bool), 1)
    cos, sin = (fake(torch.randn(1, 100, 64, dtype=torch.bfloat16), 1) for _ in range(2))
    with mode:
        grad = torch.empty(2, q.shape[2], 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    return make_fx(step, tracing_mode="real")(q, k, v, keep, cos, sin, grad), mode.shape_env


def _symbolic():
    """A fake mode with a shape environment, and a function that makes a fake of a tensor whose dimension
    dynamic_dim (if given) is a symbol: one symbol for every dynamic size of one value (duck sizing, as Dynamo's
    graphs have it)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t, dynamic_dim=None):
        sizes = [DimDynamic.DUCK if i == dynamic_dim else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    return mode, fake


# Each graphopt kernel's outputs, the arguments it writes (kernels/lora.py, kernels/gated_activation.py,
# kernels/rope.py, kernels/padded_attention.py)
WRITES = {"_project_kernel": ("Y",), "_reduce_rows_pair_kernel": ("P",), "_sum_splits_kernel": ("FIRST", "SECOND"),
          "_add_low_rank_kernel": ("OUT",), "_gated_backward_kernel": ("DG", "DU"), "_rope_kernel": ("QO", "KO"),
          "_rows_kernel": ("PADDED",)}
# with IN_PLACE=True, TO_FLAT=True
FLAG_WRITES = {"_gated_backward_kernel": ("IN_PLACE", ("G", "U")), "_rows_kernel": ("TO_FLAT", ("FLAT",))}


def declared_accesses(kernel, kwargs, tma_descriptor_metadata):
    """torch's analysis of the arguments a Triton kernel reads and writes, from WRITES: every tensor read, the
    outputs written."""
    from torch._higher_order_ops.triton_kernel_wrap import TensorAccesses
    from torch._inductor.dependencies import ReadWrites, StarDep
    from torch._inductor.ir import TensorBox
    from torch.utils._ordered_set import OrderedSet

    tensors = [name for name, value in kwargs.items() if isinstance(value, (torch.Tensor, TensorBox))]
    name = getattr(kernel, "fn", kernel).__name__
    flag, flagged = FLAG_WRITES.get(name, (None, None))
    written = flagged if flag and kwargs.get(flag) else WRITES[name]
    return TensorAccesses(ReadWrites(reads=OrderedSet(StarDep(name) for name in tensors),
                                     writes=OrderedSet(StarDep(name) for name in tensors if name in written),
                                     index_exprs=OrderedSet()), can_fuse_epilogue=False)


def lowered(gm, shape_env):
    """Inductor's lowering of gm (after the post-grad passes that follow graphopt's: reinplacing, the functional
    Triton calls made mutating), without code generation: for each graph input, how many buffers compute a value
    from it (one per layer when each value the LoRA ops read is computed once, whatever number of kernels read
    it), and the kernels' arguments reinplacing left to copy (none where each tensor a kernel writes over is read
    no more)."""
    from torch._inductor.fx_passes.post_grad import decompose_triton_kernel_wrapper_functional
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.graph import GraphLowering
    from torch._inductor.ir import ComputedBuffer
    from torch._inductor.virtualized import V

    reinplace_inplaceable_ops(FakeTensorUpdater(gm), gm.graph)
    clones = [name for n in gm.graph.find_nodes(op="call_function",
                                                target=torch.ops.higher_order.triton_kernel_wrapper_functional)
              for name in n.kwargs["tensors_to_clone"]]
    decompose_triton_kernel_wrapper_functional(gm.graph)
    gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [n.meta["val"] for n in placeholders]
    graph = GraphLowering(gm, example_inputs=inputs, shape_env=shape_env)
    with V.set_graph_handler(graph), V.set_fake_mode(detect_fake_mode(inputs)):
        graph.run(*inputs)
        reads = [{dep.name for dep in buffer.get_read_writes().reads}
                 for buffer in graph.buffers if isinstance(buffer, ComputedBuffer)]
    return {n.name: sum(n.name in names for names in reads) for n in placeholders}, clones


def main(layers, width):
    from torch._higher_order_ops import triton_kernel_wrap

    from graphopt.kernels import layout, padded_attention
    from graphopt.lowering import registry, traced
    from graphopt.lowering.direct import DirectCalls, traced_note

    padded_attention.supported = lambda q, k, v: True  # the flash kernels' inputs, but for the device
    layout.platform = lambda t: "cuda"
    layout.multiprocessors = lambda device: 132  # the H100's and H200's
    traced._probe = lambda *args: None
    triton_kernel_wrap.identify_accessed_tensors = declared_accesses
    traces = []
    trace = traced._trace
    traced._trace = lambda *args: traces.append(str(args[0])) or trace(*args)
    if width == "attention":
        gm, shape_env = attention_calls_over_symbolic_tokens(layers)
    else:
        gm, shape_env = lora_calls_over_symbolic_tokens(layers, int(width))
    lowering = registry.lowering_for("cuda")
    calls = DirectCalls(lowering.direct_calls, lowering.traced_launches)
    calls(gm.graph)
    gm.graph.lint()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    launches = [n.kwargs for n in gm.graph.find_nodes(op="call_function",
                                                     target=torch.ops.higher_order.triton_kernel_wrapper_functional)]
    side_table = triton_kernel_wrap.kernel_side_table

    def named(name):
        return [k for k in launches if side_table.get_kernel(k["kernel_idx"]).fn.__name__ == name]

    gated = [{**k["kwargs"], **side_table.get_constant_args(k["constant_args_idx"])}["IN_PLACE"]
             for k in named("_gated_backward_kernel")]
    buffers, clones = lowered(gm, shape_env)
    print(json.dumps({
        "graphopt_calls_left": [str(t) for t in targets if "graphopt" in str(t)
                                and t not in (traced.ADDMM_, padded_attention.SEQUENCES)],
        "sequences_calls": sum(t is padded_attention.SEQUENCES for t in targets),
        "launches": len(launches),
        "kernels": collections.Counter(side_table.get_kernel(k["kernel_idx"]).fn.__name__ for k in launches),
        "sorts": sum(t is torch.ops.aten.sort.stable for t in targets),
        "flash_calls": sum(t in (torch.ops.aten._flash_attention_forward.default,
                                 torch.ops.aten._flash_attention_backward.default) for t in targets),
        "gated_launches_in_place": gated,
        "projection_splits": [int(k["grid"][0][2]) for k in named("_project_kernel")],
        "addmms": sum(t is torch.ops.aten.addmm.default for t in targets),
        "addmms_in_place": sum(t is traced.ADDMM_ for t in targets),
        "mms": sum(t is torch.ops.aten.mm.default for t in targets),
        "traces": traces,
        "guards": [str(guard.expr) for guard in shape_env.guards],
        "note": traced_note(calls),
        "buffers_per_input": buffers,
        "clones_after_reinplacing": clones,
    }))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else 64)
