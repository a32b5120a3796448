"""The peak device memory of one training step through a partitioned graph pair, estimated from the graphs alone.

A walk over each graph in execution order: every node's outputs are allocated when it runs and freed after the
last reader of them or of any view of them; the graph's inputs (weights, ids) stay for the whole step, and the
forward's saved outputs stay until the backward's last reader of each. Offloaded tensors leave the device after
their last forward reader (the copy out starts as each is written) and come back at their first backward reader.
The estimate is of what the compiled graphs hold: the optimizer's state and anything else outside them is not in it.

Inductor fuses pointwise nodes into their readers, so a pointwise node whose readers are all pointwise or
reductions allocates nothing here; what else Inductor fuses or reorders the walk does not know
(benchmarks/RESULTS.md compares estimated and measured peaks).
Sizes are the graph's own: ints, or sympy expressions in its size symbols under dynamic shapes; the walk orders
by the symbols' current values (hints) and reports the expression at the peak.
"""

import operator
from dataclasses import dataclass

import torch

from graphopt.passes.describe import bytes_written, plain, size_hint


@dataclass
class MemoryEstimate:
    peak: object  # bytes: int, or a SymInt under dynamic shapes
    forward_peak: object
    backward_peak: object
    at_peak: list  # the largest buffers live at the peak, besides the graph's inputs
    saved: object  # bytes of activations on the device between forward and backward (offloaded ones excluded)

    def to_json(self) -> dict:
        return {"estimated_peak_bytes": plain(self.peak), "forward_peak_bytes": plain(self.forward_peak),
                "backward_peak_bytes": plain(self.backward_peak), "saved_on_device_bytes": plain(self.saved),
                "at_peak": self.at_peak}


def estimate_peak(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, offloaded=None) -> MemoryEstimate:
    """offloaded: {name: name} of the saved tensors passes/offload.py moves to the host (backward placeholder
    names), each to the forward node after which its device buffer is freed (passes/offload.py held_until)."""
    offloaded = offloaded or {}
    inputs = [p for p in forward.graph.find_nodes(op="placeholder")]
    resident = sum((bytes_written(p) for p in inputs), 0)
    saved = [n for n in forward.graph.find_nodes(op="output")[0].args[0] if isinstance(n, torch.fx.Node)]
    kept = {n for n in saved if n.op != "placeholder" and n.name not in offloaded}
    by_name = {n.name: n for n in forward.graph.nodes}
    leaving = {n: by_name[offloaded[n.name]] for n in saved if n.name in offloaded}
    forward_peak, forward_live = walk_peak(forward, resident=resident, keep=kept, leaving=leaving)
    on_device = [p for p in backward.graph.find_nodes(op="placeholder")
                 if not p.name.startswith("primals") and p.name not in offloaded]
    backward_peak, backward_live = walk_peak(
        backward, resident=resident, start=on_device,
        arriving={p for p in backward.graph.find_nodes(op="placeholder") if p.name in offloaded})
    saved_on_device = sum((bytes_written(p) for p in on_device if not p.name.startswith("tangents")), 0)
    if size_hint(forward_peak) >= size_hint(backward_peak):
        return MemoryEstimate(forward_peak, forward_peak, backward_peak, _largest("forward", forward_live),
                              saved_on_device)
    return MemoryEstimate(backward_peak, forward_peak, backward_peak, _largest("backward", backward_live),
                          saved_on_device)


def _largest(graph, live, count=5):
    ranked = sorted(live, key=lambda node: size_hint(bytes_written(node)), reverse=True)[:count]
    return [{"graph": graph, "node": node.name, "op": _made_by(node), "bytes": plain(bytes_written(node))}
            for node in ranked]


def _made_by(node):
    if node.op != "placeholder":
        return str(node.target)
    return "gradient of an output" if node.name.startswith("tangents") else "saved by the forward"


def walk_peak(gm, resident, keep=(), start=(), arriving=(), leaving=()):
    """(peak bytes over the graph's execution: resident + live buffers, the buffers live then). keep: never
    freed (saved for backward); start: live at the start, freed after their last reader; arriving: allocated
    at their first reader; leaving: {output that goes to the host: the node after which it is freed}, or freed
    after its last reader in the graph, if later (the output node's read is the copy out)."""
    nodes = list(gm.graph.nodes)
    root = {}  # node → the node whose buffer it reads through (views, getitems)
    for node in nodes:
        source = _aliased(node)
        root[node] = root.get(source, source) if source is not None else node
    last_use = {}
    index = {node: i for i, node in enumerate(nodes)}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            if not (node.op == "output" and arg in leaving):
                last_use[root[arg]] = i
    for node, holder in dict(leaving).items():  # kept until the offload that waits for its copy
        last_use[root[node]] = max(last_use.get(root[node], 0), index[holder])
    keep = {root[node] for node in keep}
    fused = {node for node in nodes if _fused_away(node, keep)}
    for node in reversed(nodes):  # a fused node's inputs are read where its readers run
        if node in fused and node in last_use:
            for arg in node.all_input_nodes:
                last_use[root[arg]] = max(last_use[root[arg]], last_use[node])
    allocated = {}  # buffer (root node) → the index it is allocated at
    for node in start:
        allocated[node] = -1
    for i, node in enumerate(nodes):
        if node.op == "call_function" and root[node] is node and node not in fused and not _is_tuple(node):
            allocated[node] = i  # a tuple's elements are allocated by their getitems, each freed on its own
    first_use = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            if arg in arriving:
                first_use.setdefault(arg, i)
    allocated.update(first_use)
    frees_at = {}
    for buffer, at in allocated.items():
        if buffer not in keep and buffer.op != "output":
            frees_at.setdefault(max(last_use.get(buffer, at), at, 0), []).append(buffer)
    allocates_at = {}
    for buffer, at in allocated.items():
        allocates_at.setdefault(at, []).append(buffer)

    def live_at(step_limit):
        """Buffers live while node `step_limit` runs, and the hint of their total."""
        live = set(allocates_at.get(-1, []))
        best_total, best_step, total = -1, None, sum(size_hint(bytes_written(b)) for b in live)
        for i in range(len(nodes)):
            for buffer in allocates_at.get(i, []):
                live.add(buffer)
                total += size_hint(bytes_written(buffer))
            if i == step_limit:
                return live
            if total > best_total:
                best_total, best_step = total, i
            for buffer in frees_at.get(i, []):
                if buffer in live:
                    live.discard(buffer)
                    total -= size_hint(bytes_written(buffer))
        return best_step

    peak_step = live_at(None)
    live = live_at(peak_step) if peak_step is not None else set()
    return resident + sum((bytes_written(b) for b in live), 0), live


_REDUCTIONS = {torch.ops.aten.sum, torch.ops.aten.mean, torch.ops.aten.amax, torch.ops.aten.amin,
               torch.ops.aten.var_mean, torch.ops.aten.prod}


def _pointwise(node):
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and (
        torch.Tag.pointwise in getattr(node.target, "tags", ()) or packet in (torch.ops.aten._to_copy,
                                                                              torch.ops.prims.convert_element_type))


def _fused_away(node, keep):
    """Inductor fuses a pointwise node into its readers when they are all pointwise or reductions: its result
    is never written to memory. Outputs of the graph are always written."""
    return (_pointwise(node) and node not in keep and node.users
            and all(user.op == "call_function" and (_pointwise(user) or getattr(user.target, "overloadpacket", None)
                                                    in _REDUCTIONS) for user in node.users))


def _aliased(node):
    """The node whose buffer `node` reads through without allocating: a view's base. (A getitem of an op's
    tuple of outputs is that output's own buffer.)"""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if getattr(node.target, "is_view", False) or (node.target is operator.getitem and not _is_tuple(node.args[0])):
        return node.args[0]
    return None


def _is_tuple(node):
    return isinstance(node.meta.get("val"), (tuple, list))
