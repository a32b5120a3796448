"""The rewrite skeleton the fusion passes share: a Miss says why a candidate stays as it is (the report's miss
reason); replace() puts the fused call where the subgraph's result was and erases what nothing reads any more."""

from torch.fx import Node

from graphopt.passes.describe import operation


class Miss(Exception):
    """The candidate cannot be proven to compute what the fused op computes; the message says why."""


def check_only_inside(nodes, end: Node, what: str) -> None:
    """Miss when a node of the subgraph other than its end is read outside it: the fused op would drop that value."""
    inside = set(nodes)
    for node in nodes:
        outside = [u for u in node.users if u not in inside] if node is not end else []
        if outside:
            raise Miss(f"an intermediate of the {what} ({operation(node)}) is also read outside it, by "
                       f"{', '.join(operation(u) for u in outside)}")


def replace(end: Node, target, args, meta=None, dead=()) -> Node:
    """target(*args) inserted before end, with end's metadata (or meta), taking over end's uses; then end and the
    nodes of `dead` are erased once nothing reads them."""
    graph = end.graph
    with graph.inserting_before(end):
        new = graph.call_function(target, tuple(args))
    new.meta = dict(end.meta) if meta is None else meta
    end.replace_all_uses_with(new)
    erase_unused([end, *dead])
    return new


def erase_unused(nodes, inputs: bool = False) -> None:
    """Erase each of nodes that nothing reads, users before what they use; with inputs, then the nodes they read
    too, as long as nothing else reads them (a mask's construction, once no attention reads it)."""
    graph = next((n.graph for n in nodes), None)
    if graph is None:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    pending, erased = sorted(set(nodes), key=order.get, reverse=True), set()
    while pending:
        node = pending.pop(0)
        if node in erased or node.users or node.op not in ("call_function", "call_method"):
            continue
        readers = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        if inputs:
            pending = sorted(set(pending) | set(readers), key=order.get, reverse=True)
