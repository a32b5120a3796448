"""Targets → how each runs the graphopt ops. The only module, with the target files, that knows devices."""

from dataclasses import dataclass, field

import torch
from torch._inductor.decomposition import select_decomp_table

from graphopt.lowering import ascend, cpu, ops
from graphopt.passes.match import autocast_dtype, autocast_regions, value
from graphopt.plan import LoweringRecord

try:  # Triton is a Linux dependency; elsewhere the CUDA lowering is simply absent.
    from graphopt.lowering import cuda
except ImportError as error:
    cuda, _CUDA_MISSING = None, str(error)
    _CUDA_DIRECT = {}
else:
    _CUDA_DIRECT = cuda.register()
    cuda.expandable_segments_on_import()
    cuda.order_for_peak_memory()
    cuda.reuse_where_the_estimate_sees()


_REFERENCES = {op: "pure-torch reference (kernels/reference.py)" for op in ops.ALL_OPS}
_CPU_DIRECT = cpu.direct_calls()
_ASCEND_KERNELS = []  # the Library that registers lowering/ascend.py for the NPU, once a graph targets it


@dataclass
class Lowering:
    target: str
    inductor: bool  # compile the rest of the graph with Inductor (else: run it eagerly)
    decompositions: dict = field(default_factory=dict)  # graphopt op → aten function, applied below autograd
    implementations: dict = field(default_factory=dict)  # graphopt op → text for the report
    note: str = ""
    # offload=True copies saved activations to host memory (lowering/transfer.py); on the CPU target they are
    # there already, so the plan is only reported
    offload_copies: bool = True
    # cuda_graphs="auto" may replay the graphs as CUDA graphs: measured faster on NVIDIA only (the H200)
    cuda_graphs: bool = False
    # aten ops (Inductor's names) that run between the CUDA graphs' captured partitions
    uncapturable_ops: tuple = ()
    # graphopt op → fn(its tensor inputs as it runs them, autocast applied: Running) → the text when it is not the
    # usual implementation's (None when it is): the report names what actually runs
    variants: dict = field(default_factory=dict)
    # fn(the graph) run before it compiles for the target: sets up the device, returns a note for the report (or None)
    prepare: object = None
    # graph call → the function it is traced as on the meta device (graphopt explain): as the target runs it,
    # where the meta device would take another form (SDPA's math form on meta, a fused kernel on a GPU)
    meta_stand_ins: dict = field(default_factory=dict)
    # graphopt op → the op the graphs Inductor compiles call instead: the same kernel without custom_op's layers
    # (lowering/direct.py)
    direct_calls: dict = field(default_factory=dict)
    # graphopt op → its launch function, traced into the graphs where CUDA graphs are off (lowering/traced.py);
    # such an op is not decomposed there
    traced_launches: dict = field(default_factory=dict)
    # graphopt op → text for the report where its launches are traced, when not the usual implementation's
    traced_implementations: dict = field(default_factory=dict)


def lowering_for(target: str) -> Lowering:
    if target in ("cuda", "hip") and cuda is not None:
        note = "" if target == "cuda" else ("Triton kernels with AMD launch settings per family, CDNA or RDNA "
                                            "(kernels/layout.py), compiled for gfx942 and gfx1100 in CI; "
                                            "not yet measured on AMD GPUs")
        return Lowering(target, inductor=True, decompositions=dict(cuda.DECOMPOSITIONS),
                        implementations=dict(cuda.IMPLEMENTATIONS), note=note, cuda_graphs=target == "cuda",
                        uncapturable_ops=cuda.UNCAPTURABLE_OPS,
                        prepare=cuda.prepare if target == "cuda" else None,
                        meta_stand_ins=dict(cuda.META_STAND_INS), direct_calls=dict(_CUDA_DIRECT),
                        traced_launches=dict(cuda.TRACED) if target == "cuda" else {},
                        traced_implementations=dict(cuda.TRACED_IMPLEMENTATIONS) if target == "cuda" else {},
                        variants={torch.ops.graphopt.lora_down.default: cuda.lora_down_variant,
                                  torch.ops.graphopt.lora_linear.default: cuda.lora_variant,
                                  torch.ops.graphopt.lora_linear_4bit.default: cuda.lora_4bit_variant,
                                  torch.ops.graphopt.padded_attention.default: cuda.attention_variant,
                                  torch.ops.graphopt.packed_attention.default: cuda.attention_variant})
    if target == "cpu":
        return Lowering(target, inductor=True, decompositions=dict(cpu.DECOMPOSITIONS),
                        implementations=dict(cpu.IMPLEMENTATIONS), offload_copies=False,
                        direct_calls=dict(_CPU_DIRECT))
    if target == "npu":
        if not _ASCEND_KERNELS:
            _ASCEND_KERNELS.append(ascend.register())
        return Lowering(target, inductor=False, implementations={**_REFERENCES, **ascend.IMPLEMENTATIONS},
                        note="Ascend: torch_npu fused operators (lowering/ascend.py), the graph run eagerly; "
                             "not yet run on Ascend hardware")
    if target == "mps":
        reason = "Apple MPS: every op runs its pure-torch reference and the graph runs eagerly (no fused kernels yet)"
    else:
        reason = f"no lowering for target {target!r}" + ("" if cuda is not None else
                                                         f" (Triton missing: {_CUDA_MISSING})")
    # MPS memory is the host's (unified): offload=True is reported, not copied
    return Lowering(target, inductor=False, implementations=dict(_REFERENCES), note=reason,
                    offload_copies=target != "mps")


class InductorDecompositions(dict):
    """The table compile_fx takes: Inductor's decompositions and the target's for graphopt ops, but for the ops
    whose launches are traced into the graphs (traced=True: CUDA graphs off). Inductor's FX graph cache pickles it
    into its key, and some of Inductor's own entries are builtins it cannot pickle, which would keep every compile
    out of the cache: it pickles as what it is made from (graphopt's code is in the key through the partitioner's
    uuid, passes/recompute.py)."""

    def __init__(self, target: str, traced: bool = False):
        lowering = lowering_for(target)
        super().__init__({**select_decomp_table(),
                          **{op: f for op, f in lowering.decompositions.items()
                             if not (traced and op in lowering.traced_launches)}})
        self.target, self.traced = target, traced

    def __reduce__(self):
        return InductorDecompositions, (self.target, self.traced)


def record(gm: torch.fx.GraphModule, lowering: Lowering, report, traced: bool = False) -> None:
    """One report line per graphopt op and implementation in the graph: how it will run (traced: with the launches
    traced into the graphs), its backward op beside it."""
    implementations = {**lowering.implementations, **(lowering.traced_implementations if traced else {})}
    counts = {}
    regions = autocast_regions(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops.BACKWARD_OF:
            variant = lowering.variants.get(node.target)
            text = variant(*_running_inputs(node, regions[node])) if variant else None
            key = (node.target, text or implementations[node.target])
            counts[key] = counts.get(key, 0) + 1
    for (forward, implementation), count in counts.items():
        backward = ops.BACKWARD_OF[forward]
        variant = implementation != implementations[forward]  # the backward runs the same variant
        report.lowering.append(LoweringRecord(str(forward), count, implementation, lowering.note or None))
        if backward is not None:
            report.lowering.append(LoweringRecord(str(backward), count,
                                                  implementation if variant else implementations[backward],
                                                  "in the backward graph, when gradients are needed"))


@dataclass(frozen=True)
class Running:
    """A tensor input of a graphopt op as the op runs it: its dtype after autocast, its shape and device."""
    dtype: torch.dtype
    shape: tuple
    device: torch.device


def _running_inputs(node, autocast: dict) -> list:
    """A graphopt op's tensor inputs (None where an optional one is absent), their dtypes cast by the op's autocast
    rule inside a region."""
    casts = ops.AUTOCAST_CASTS.get(node.target.name().split("::")[-1], ())
    inputs = []
    for i, arg in enumerate(node.args):
        v = value(arg)
        if isinstance(v, torch.Tensor):
            cast = autocast_dtype(autocast, v.device.type) if i in casts and v.dtype != torch.float64 else None
            inputs.append(Running(cast or v.dtype, tuple(v.shape), v.device))
        elif arg is None:
            inputs.append(None)
    return inputs
