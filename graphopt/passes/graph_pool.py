"""Under CUDA graphs, what outlives a training step is copied out of the graphs' memory pool.

Inductor's CUDA graph trees place every output of a graph in a private memory pool that the next step's replay
writes over. Two kinds of output routinely outlive a step:

- the parameters' gradients: autograd installs the backward's output itself as `.grad`, and with gradient
  accumulation the next micro-batch adds into it, after the next forward's replay has reused that memory. torch
  (2.11 to 2.13) then raises on the access, or, in older releases, adds into overwritten memory silently.
- the loss: training loops keep it, or a list of them, to log every N steps.

So the partitioned graphs route the gradients of the leaf tensors (the trainable parameters) and the scalar
outputs (the loss) through graphopt::copy_out_of_graph_pool, an op CUDA graphs may not capture: it runs between
the captured parts (Inductor's graph partitions), and its copies are ordinary allocations. For LoRA the
gradients are the adapters' (1B shape: 45 MiB, 8B: 160 MiB). The backward copies them out in groups as it
computes them, each group right after its last gradient, about GRADIENT_GROUPS of them: copied at the end, every
gradient would be in the pool at once, and the pool keeps what it reserved for them (its small blocks, since an
adapter's gradient is under 1 MiB) beside the copies, 160 MiB more reserved at the 8B shape; in groups it holds
one group's, for a graph launch and a multi-tensor copy more per group. Other outputs (the logits with
keep_logits, the KV cache) stay in the pool: reading one after the next step raises torch's error, which names
the fix (clone it).
"""

import operator

import torch
from torch.fx import GraphModule

# the pool holds an eighth of the gradients at once (8B: 20 of 160 MiB) for 8 partitions more than one copy at the
# end, each a graph replay and a multi-tensor copy
GRADIENT_GROUPS = 8


def copy_out_of_graph_pool(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int,
                           num_primals: int, leaf_inputs) -> int:
    """Insert the copies into the forward (its scalar user outputs) and the backward (the gradients of the inputs
    whose indices are in leaf_inputs, or of every input when the primals are not the compiled graph's inputs one
    for one); return how many tensors are copied."""
    user_outputs = _outputs(forward)[:num_fwd_outputs]
    scalars = [i for i, node in enumerate(user_outputs) if _is_scalar(node)]
    grads = _outputs(backward)
    if len(grads) != num_primals:
        raise AssertionError(f"graphopt: the backward returns {len(grads)} values for {num_primals} inputs, so "
                             f"the parameters' gradients cannot be told apart to copy them out of the CUDA graphs' "
                             f"pool; compile with options={{'cuda_graphs': False}} and report this graph")
    wanted = set(range(num_primals)) if leaf_inputs is None else set(leaf_inputs)
    copied = [i for i in sorted(wanted) if isinstance(grads[i], torch.fx.Node)]
    return _route(forward, [scalars]) + _route(backward, _as_computed(backward, copied))


def _outputs(gm):
    return list(gm.graph.output_node().args[0])


def _is_scalar(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _as_computed(gm, indices) -> list:
    """The output indices in groups of about 1/GRADIENT_GROUPS of their bytes, in the order the graph computes
    them."""
    values = _outputs(gm)
    position = {node: k for k, node in enumerate(gm.graph.nodes)}
    indices = sorted(indices, key=lambda i: position[values[i]])
    nbytes = {i: _nbytes(values[i]) for i in indices}
    share = sum(nbytes.values()) / GRADIENT_GROUPS
    groups, group, size = [], [], 0
    for i in indices:
        group.append(i)
        size += nbytes[i]
        if size >= share:
            groups.append(group)
            group, size = [], 0
    return groups + [group] * bool(group)


def _nbytes(node):
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _route(gm, groups) -> int:
    """Replace the outputs at each group's indices by their copies, one graphopt::copy_out_of_graph_pool call a
    group, right after the last of them is computed; return how many outputs are copied."""
    groups = [group for group in groups if group]
    if not groups:
        return 0
    output = gm.graph.output_node()
    values = _outputs(gm)
    position = {node: k for k, node in enumerate(gm.graph.nodes)}
    last_placeholder = [n for n in gm.graph.nodes if n.op == "placeholder"][-1:]
    for indices in groups:
        sources = [values[i] for i in indices]
        last = max(sources + last_placeholder, key=position.get)
        with gm.graph.inserting_before(last.next):
            copies = gm.graph.call_function(torch.ops.graphopt.copy_out_of_graph_pool.default, (sources,))
            copies.meta["val"] = [s.meta["val"] for s in sources]
            for k, (i, source) in enumerate(zip(indices, sources)):
                item = gm.graph.call_function(operator.getitem, (copies, k))
                item.meta = dict(source.meta)
                values[i] = item
    output.args = (type(output.args[0])(values),) + tuple(output.args[1:])
    gm.recompile()
    return sum(len(group) for group in groups)
