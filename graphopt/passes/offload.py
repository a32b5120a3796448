"""offload=True: the activations the backward reads go to host memory in the forward and come back just before
the backward needs them (the copies and streams: lowering/transfer.py).

Runs on the partitioned graphs, so it moves exactly what the partitioner (passes/recompute.py) decided to save.
Each saved activation is either offloaded or kept on the device with a reason the report shows:
- kept: an output of the model too, a view (its base stays on the device anyway), non-contiguous (the copy
  would change its layout), or small (under 1/64 of the largest saved activation: per-copy latency would cost
  more than it frees, e.g. the per-row statistics beside the layer inputs);
- kept: read by the first layer the backward runs (the last of the forward): its copy back would start as it
  is needed, with nothing to hide behind.
Groups are decoder layers (the module path up to the ModuleList index). In the forward, each copy starts right
after its tensor is written, and the next layer's first offload waits for it (taking the tensor as an input, so
that Inductor keeps it until then). In the backward, the first reload of a layer starts copying the next layer's
tensors, so each layer's copies run under the compute of the layer before, except across the end of a part CUDA
graphs capture (prefetch_within_partitions). A tensor of symbolic shape (a graph
compiled for every length) is offloaded as any other: its reload takes its sizes from the symbols the backward
receives; kept only where a size is an expression the backward cannot rebuild from them.
Whether the copies are made is the target lowering's word (Lowering.offload_copies): on the CPU target the plan is
made and reported, and the graphs are left as they are, since there is nowhere to move to.
"""

import operator
from dataclasses import dataclass, field

import sympy
import torch
from torch._subclasses.fake_tensor import extract_tensor_metadata

from graphopt.passes.describe import bytes_written, layer_of, plain, size_hint

SMALL_FRACTION = 1 / 64


@dataclass
class OffloadPlan:
    num_fwd_outputs: int  # the forward's outputs before this index are the model's, never replaced
    offloaded: list = field(default_factory=list)  # backward placeholder names, in the order the backward reads them
    groups: dict = field(default_factory=dict)  # name → its layer
    kept: dict = field(default_factory=dict)  # name → why it stays on the device
    sizes: dict = field(default_factory=dict)  # name → bytes
    moves_data: bool = False  # False on the CPU target (lowering/registry.py): planned and reported, graphs unchanged

    def prefetch_after(self):
        """name → the names its reload starts copying: the first reload of a layer prefetches the next layer."""
        order = []
        for name in self.offloaded:
            if not order or order[-1][0] != self.groups[name]:
                order.append((self.groups[name], []))
            order[-1][1].append(name)
        return {members[0]: following[1] for (_, members), following in zip(order, order[1:])}

    def to_json(self, layers: dict) -> dict:
        """The report's view: totals, and bytes offloaded per layer (added to `layers`, the per-layer entries)."""
        for name in self.offloaded:
            entry = layers.setdefault(self.groups[name], {})
            entry["offloaded_bytes"] = entry.get("offloaded_bytes", 0) + self.sizes[name]
        reasons = {}
        for name, reason in self.kept.items():
            count, size = reasons.get(reason, (0, 0))
            reasons[reason] = (count + 1, size + self.sizes[name])
        return {"tensors": len(self.offloaded), "bytes": plain(sum(self.sizes[n] for n in self.offloaded)),
                "copies_made": self.moves_data,
                "kept": [{"reason": r, "tensors": c, "bytes": plain(b)} for r, (c, b) in reasons.items()]}


def plan_offload(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int,
                 copies: bool) -> OffloadPlan:
    """num_fwd_outputs: how many of the forward graph's outputs are the model's (the rest are saved for backward);
    copies: whether the target's lowering moves data (not on the CPU target: the plan is only reported)."""
    outputs = forward.graph.find_nodes(op="output")[0].args[0]
    model_outputs = set(outputs[:num_fwd_outputs])
    saved = {node.name: node for node in outputs[num_fwd_outputs:] if isinstance(node, torch.fx.Node)}
    order = {node: i for i, node in enumerate(backward.graph.nodes)}
    candidates = []
    for placeholder in backward.graph.find_nodes(op="placeholder"):
        value = placeholder.meta.get("val")
        produced = saved.get(placeholder.name)
        if (produced is None or produced.op == "placeholder" or not isinstance(value, torch.Tensor)
                or not placeholder.users):
            continue  # an incoming gradient, a graph input kept (weights, ids), a symbol, or unread
        first_use = min(order[user] for user in placeholder.users)
        candidates.append((first_use, placeholder, produced, value))
    candidates.sort(key=lambda c: c[0])

    symbols = _symbol_inputs(backward)
    plan = OffloadPlan(num_fwd_outputs, moves_data=copies)
    largest = max((bytes_written(p) for _, p, *_ in candidates), key=size_hint, default=0)
    first_group = layer_of(candidates[0][1]) if candidates else None
    for _, placeholder, produced, value in candidates:
        name = placeholder.name
        plan.sizes[name], plan.groups[name] = bytes_written(placeholder), layer_of(placeholder)
        if produced in model_outputs:
            plan.kept[name] = "also an output of the model: it stays on the device anyway"
        elif getattr(produced.target, "is_view", False) or value._base is not None:
            plan.kept[name] = "a view: its base stays on the device"
        elif not value.is_contiguous():
            plan.kept[name] = "not contiguous"
        elif not all(_buildable(size, symbols) for size in value.shape):
            plan.kept[name] = "a symbolic size the backward does not receive the symbols of"
        elif size_hint(plan.sizes[name]) < size_hint(largest) * SMALL_FRACTION:
            plan.kept[name] = "small: under 1/64 of the largest saved activation"
        elif plan.groups[name] == first_group:
            plan.kept[name] = "read first by the backward: no compute to hide its copy behind"
        else:
            plan.offloaded.append(name)
    return plan


def layer_runs(forward: torch.fx.GraphModule, plan: OffloadPlan) -> list:
    """The offloaded tensors' forward nodes in the order the forward writes them, as runs of one layer each:
    [(layer, [node, ...]), ...]. The first offload of a run waits for the copies of the run before."""
    chosen = set(plan.offloaded)
    output = forward.graph.find_nodes(op="output")[0]
    saved = set(output.args[0][plan.num_fwd_outputs:])
    runs = []
    for node in forward.graph.nodes:
        if node.name in chosen and node in saved:
            if not runs or runs[-1][0] != plan.groups[node.name]:
                runs.append((plan.groups[node.name], []))
            runs[-1][1].append(node)
    return runs


def held_until(forward: torch.fx.GraphModule, plan: OffloadPlan) -> dict:
    """name → the offloaded tensor whose offload waits for its copy, after which its device buffer is freed: the
    next run's first, or for the last run, the forward's last offloaded tensor. The one rule that
    insert_transfers builds the waits from and the memory estimate frees by."""
    runs = layer_runs(forward, plan)
    until = {}
    for (_, members), following in zip(runs, runs[1:] + [None]):
        holder = following[1][0] if following else runs[-1][1][-1]
        until.update({node.name: holder.name for node in members})
    return until


def insert_transfers(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, plan: OffloadPlan) -> None:
    """forward: graphopt::offload right after each chosen tensor is written, its token saved instead; the first
    offload of each layer waits for the copies of the layer before (and keeps those tensors alive until then),
    the last one for the copies still running. backward: graphopt::reload before each one's first reader,
    carrying the next layer's prefetch."""
    output = forward.graph.find_nodes(op="output")[0]
    model_outputs, saved = output.args[0][:plan.num_fwd_outputs], output.args[0][plan.num_fwd_outputs:]
    in_order = [node for _, members in layer_runs(forward, plan) for node in members]
    held_by = {}  # holder name → the earlier offloaded tensors it waits for (held_until: one rule for both)
    for name, holder in held_until(forward, plan).items():
        held_by.setdefault(holder, []).append(name)
    tokens = {}
    for node in in_order:
        waits_for = [n for n in in_order if n.name in held_by.get(node.name, ()) and n is not node]
        last = node is in_order[-1]  # also waits for its own copy
        with forward.graph.inserting_after(node):
            token = forward.graph.call_function(
                torch.ops.graphopt.offload.default, (node, [tokens[n] for n in waits_for], waits_for, last))
        _set_value(token, torch.ops.graphopt.offload.default(node.meta["val"], [], [], last))
        token.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        tokens[node] = token
    output.args = (tuple(model_outputs) + tuple(tokens.get(n, n) for n in saved),) + tuple(output.args[1:])

    placeholders = {p.name: p for p in backward.graph.find_nodes(op="placeholder")}
    symbols = _symbol_inputs(backward)
    order = {node: i for i, node in enumerate(backward.graph.nodes)}
    first_user = {name: min(placeholders[name].users, key=order.get) for name in plan.offloaded}
    prefetch = plan.prefetch_after()
    is_reload = lambda user: user.target is torch.ops.graphopt.reload.default  # noqa: E731
    for name in plan.offloaded:
        placeholder = placeholders[name]
        value = placeholder.meta["val"]
        _set_value(placeholder, torch.ops.graphopt.offload.default(value, [], [], False))
        with backward.graph.inserting_before(first_user[name]):
            shape = [_size_node(backward.graph, size, symbols) for size in value.shape]
            reload = backward.graph.call_function(
                torch.ops.graphopt.reload.default,
                (placeholder, shape, value.dtype, value.device, [placeholders[n] for n in prefetch.get(name, [])]))
        _set_value(reload, value)
        reload.meta["nn_module_stack"] = placeholder.meta.get("nn_module_stack", {})
        # every reader but the reloads, whose prefetch lists name the token itself
        placeholder.replace_all_uses_with(reload, delete_user_cb=lambda user: not is_reload(user))
    forward.graph.lint()
    backward.graph.lint()
    forward.recompile()
    backward.recompile()


def prefetch_within_partitions(backward: torch.fx.GraphModule) -> int:
    """Under CUDA graphs: a reload starts no copy that a reload beyond the next op CUDA graphs may not capture
    (a cudagraph_unsafe op, as graph_pool's copies, where Inductor ends a captured partition) would wait for.
    Such a copy would be an allocation of one partition held past its end outside its outputs, which CUDA graph
    trees refuse ("not tracked as outputs"), and a side stream its capture never joins. The reload beyond loads
    its tensor itself (its copy not hidden). Returns how many prefetches are dropped."""
    partition, of_reload, reloads = 0, {}, []
    for node in backward.graph.nodes:
        if node.op != "call_function":
            continue
        if torch.Tag.cudagraph_unsafe in getattr(node.target, "tags", ()):
            partition += 1
        elif node.target is torch.ops.graphopt.reload.default:
            of_reload[node.args[0]] = partition
            reloads.append((node, partition))
    dropped = 0
    for node, at in reloads:
        prefetch = node.args[4]
        kept = [token for token in prefetch if of_reload.get(token) == at]
        if len(kept) != len(prefetch):
            node.args = node.args[:4] + (kept,) + node.args[5:]
            dropped += len(prefetch) - len(kept)
    if dropped:
        backward.recompile()
    return dropped


def _symbol_inputs(backward: torch.fx.GraphModule) -> dict:
    """sympy symbol → the backward's input carrying it (the SymInts AOT autograd hands the backward)."""
    symbols = {}
    for placeholder in backward.graph.find_nodes(op="placeholder"):
        value = placeholder.meta.get("val")
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            symbols.setdefault(value.node.expr, placeholder)
    return symbols


def _buildable(size, symbols) -> bool:
    """Whether _size_node can write size: an int, or sums and products of integers and received symbols."""
    if not isinstance(size, torch.SymInt):
        return True
    expr = size.node.expr
    terms = (sympy.Symbol, sympy.Integer, sympy.Add, sympy.Mul)
    return (all(s in symbols for s in expr.free_symbols)
            and all(isinstance(e, terms) for e in sympy.preorder_traversal(expr)))


def _size_node(graph: torch.fx.Graph, size, symbols):
    """size as a graph value: the int itself, or the backward's symbol inputs combined by operator.add and mul."""
    if not isinstance(size, torch.SymInt):
        return size

    def build(expr):
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            return symbols[expr]
        combine = operator.add if isinstance(expr, sympy.Add) else operator.mul
        terms = [build(arg) for arg in expr.args]
        result = terms[0]
        for term in terms[1:]:
            result = graph.call_function(combine, (result, term))
            result.meta["val"] = combine(_value(result.args[0]), _value(term))
        return result

    return build(size.node.expr)


def _value(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x


def _set_value(node, value):
    node.meta["val"] = value
    node.meta["tensor_meta"] = extract_tensor_metadata(value)

