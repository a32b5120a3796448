"""Direct calls: in the graphs Inductor compiles, each graphopt op that stays opaque is called as an op of the
target's own namespace (graphopt_cuda::lora_linear, graphopt_cpu::lora_linear), of the same schema, tags and
kernel, registered without torch.library.custom_op's layers.

custom_op wraps every call in an autograd layer (in Python, even where nothing needs a gradient), a redispatch and
a check that no output aliases an input: 16–60 µs of host time a call more than the same kernel as a plain op of
the dispatcher, on the GPU machines (benchmarks/RESULTS.md, SFT X). A compiled graph needs none of them:
aot_autograd has already put each op's backward op in the backward graph, and the fakes checked the outputs when
the graph was traced. Under dynamic shapes CUDA graphs are off and the host launches every kernel of the step, so
these layers are time the GPU waits.

The rename happens after the partition (an Inductor post-grad pass), so everything before it (fusion, the memory
plan, the report) sees the graphopt ops of the contract, and eager calls keep custom_op's checks and autograd.
The same pass may trace an op's launch function into the graph instead (lowering/traced.py), where Inductor
launches its kernels.
"""

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from graphopt.lowering import traced as traced_launches

log = logging.getLogger(__name__)

_LIBRARIES = []  # kept alive for the process


def define(target: str, dispatch_key: str, kernels: dict) -> dict:
    """{graphopt op: its direct op} for a target, the direct ops defined in namespace graphopt_<target> (once a
    process: lowering/registry.py calls it at import). kernels: graphopt op → the function the target runs it with
    on dispatch_key's tensors."""
    namespace = f"graphopt_{target}"
    library = torch.library.Library(namespace, "DEF")
    _LIBRARIES.append(library)
    calls = {}
    for op, kernel in kernels.items():
        name = op._schema.name.split("::")[1]
        library.define(str(op._schema).split("::", 1)[1], tags=tuple(op.tags))
        library.impl(name, kernel, dispatch_key)
        # the fake is the graphopt op's own, reached by calling it on the fake tensors
        torch.library.register_fake(f"{namespace}::{name}", _calling(op), lib=library)
        calls[op] = getattr(getattr(torch.ops, namespace), name).default
    return calls


def _calling(op):
    def fake(*args, **kwargs):
        return op(*args, **kwargs)
    return fake


class DirectCalls(CustomGraphPass):
    """Inductor's post-grad pass that calls each graphopt op of the forward and backward graphs by its direct op,
    or, for the ops in traced (graphopt op → its launch function), traces the launch function into the graph
    (lowering/traced.py); after the post-grad passes the user had set in the same place (Inductor's config holds
    one: graphopt's must not replace them), which see the contract's ops. An op whose trace fails is called
    directly in the rest of that graph, and the failure is logged and kept in `untraced`."""

    def __init__(self, calls: dict, traced: dict = None, before=None):
        self.calls = calls
        self.traced = traced or {}
        self.untraced = []  # (op, the error) of each trace that failed
        self.before = tuple(before) if isinstance(before, (list, tuple)) else (() if before is None else (before,))

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in self.before:
            user_pass(graph)
        traces, failed = {}, set()
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in self.calls:
                continue
            if node.target in self.traced and node.target not in failed:
                try:
                    traced_launches.inline(graph, node, self.traced[node.target], traces)
                    continue
                except Exception as error:  # the op still runs, called directly, here and in the rest of the graph
                    log.warning("graphopt: %s called directly, its launches not traced: %s", node.target, error)
                    failed.add(node.target)
                    self.untraced.append((str(node.target), repr(error)))
            node.target = self.calls[node.target]
        if traces:
            traced_launches.share_repeats(graph)

    def uuid(self):
        """What Inductor's FX graph cache keys a graph with; None (not cached) where a pass before it has none."""
        before = [user_pass.uuid() if hasattr(user_pass, "uuid") else None for user_pass in self.before]
        if None in before:
            return None
        calls = ", ".join(sorted(str(op) for op in self.calls.values()))
        traced = ", ".join(sorted(str(op) for op in self.traced))
        return f"{before!r} then graphopt direct calls: {calls}; traced: {traced}"

    def __deepcopy__(self, memo):  # Inductor copies its config for the backward's compile: ops are not copied
        return self


def traced_note(calls: DirectCalls) -> str:
    """The report's note on the ops whose launches calls traces, and on those whose trace failed so far (a backward
    graph compiles at its first run, after the report is written: its failures are logged). A graph Inductor's
    cache serves was compiled by the same pass (its uuid keys the cache)."""
    def names(ops):
        return ", ".join(sorted({str(op).removeprefix("graphopt.").removesuffix(".default") for op in ops}))
    failed = {op for op, _ in calls.untraced}
    traced = [op for op in calls.traced if str(op) not in failed]
    notes = []
    if traced:
        notes.append(f"the launch functions of {names(traced)} are traced into the graphs, and Inductor's generated "
                     f"code launches their Triton kernels and matmuls (lowering/traced.py)")
    if failed:
        notes.append(f"{names(failed)} called directly, their launches not traced: " +
                     "; ".join(error for _, error in calls.untraced))
    return "CUDA graphs off: " + "; ".join(notes)
