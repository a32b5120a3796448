"""The rewrite skeleton the fusion passes share: a Miss says why a candidate stays as it is (the report's miss
reason); replace() puts the fused call where the subgraph's result was and erases what nothing reads any more."""

from torch.fx import Node


class Miss(Exception):
    """The candidate cannot be proven to compute what the fused op computes; the message says why."""


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
