"""lowering/traced.py's trace of the LoRA ops on the NVIDIA launch path, on a machine without a GPU.

    python tests/traced_launches.py LAYERS        → one JSON line: what the traced graph holds

A graph of LAYERS LoRA layers' graphopt calls (forward and backward) over a symbolic token count, as Dynamo's
dynamic graphs have it, goes through the post-grad pass that traces their launch functions. The launch settings are
NVIDIA's, taken on CPU tensors (kernels/layout.py platform); the eager launch that fits the configs and torch's
analysis of the kernels' writes need a GPU and stand aside. tests/test_lowering.py runs this in a process of its
own: Triton's interpreter (which the CPU tests use) makes kernels that cannot be traced.
"""

import json
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext


def lora_calls_over_symbolic_tokens(layers):
    """The graph of `layers` LoRA layers' graphopt calls, forward and backward, over a symbolic token count, and its
    shape environment."""
    import graphopt  # noqa: F401  (the graphopt ops)

    ops = torch.ops.graphopt

    def step(x, w, a, b, grad):
        outputs = []
        for _ in range(layers):
            xa = ops.lora_down(x, a)
            outputs += [ops.lora_linear(x, w, None, a, b, xa, 2.0, torch.bfloat16),
                        *ops.lora_linear_backward(grad, x, xa, w, a, b, 2.0)]
        return outputs

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)

    def fake(t, dynamic_dim=None):
        sizes = [DimDynamic.DYNAMIC if i == dynamic_dim else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    x = fake(torch.randn(1, 100, 64, dtype=torch.bfloat16), 1)
    w, a, b = fake(torch.randn(96, 64, dtype=torch.bfloat16)), fake(torch.randn(16, 64)), fake(torch.randn(96, 16))
    with mode:
        grad = torch.empty(1, x.shape[1], 96, dtype=torch.bfloat16)
        return make_fx(step, tracing_mode="real")(x, w, a, b, grad), shape_env


def main(layers):
    from graphopt.kernels import layout
    from graphopt.lowering import registry, traced
    from graphopt.lowering.direct import DirectCalls, traced_note

    layout.platform = lambda t: "cuda"
    layout.multiprocessors = lambda device: 132  # the H100's and H200's
    traced._probe = lambda *args: None
    traced._check_writes = lambda graph, op: None
    traces = []
    trace = traced._trace
    traced._trace = lambda *args: traces.append(str(args[0])) or trace(*args)
    gm, shape_env = lora_calls_over_symbolic_tokens(layers)
    lowering = registry.lowering_for("cuda")
    calls = DirectCalls(lowering.direct_calls, lowering.traced_launches)
    calls(gm.graph)
    gm.graph.lint()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    print(json.dumps({
        "graphopt_calls_left": [str(t) for t in targets if "graphopt" in str(t)],
        "launches": sum(t is torch.ops.higher_order.triton_kernel_wrapper_functional for t in targets),
        "addmms": sum(t is torch.ops.aten.addmm.default for t in targets),
        "traces": len(traces),
        "guards": [str(guard.expr) for guard in shape_env.guards],
        "note": traced_note(calls),
    }))


if __name__ == "__main__":
    main(int(sys.argv[1]))
