"""Under CUDA graphs, what outlives a training step is copied out of the graphs' memory pool.

Inductor's CUDA graph trees place every output of a graph in a private memory pool that the next step's replay
writes over. Two kinds of output routinely outlive a step:

- the parameters' gradients: autograd installs the backward's output itself as `.grad`, and with gradient
  accumulation the next micro-batch adds into it, after the next forward's replay has reused that memory. torch
  (2.11 to 2.13) then raises on the access, or, in older releases, adds into overwritten memory silently.
- the loss: training loops keep it, or a list of them, to log every N steps.

So the partitioned graphs route the gradients of the leaf tensors (the trainable parameters) and the scalar
outputs (the loss) through graphopt::copy_out_of_graph_pool, an op CUDA graphs may not capture: it runs right
after the graph, and its copies are ordinary allocations. For LoRA the gradients are the adapters' (1B shape:
45 MiB) and the copy is a few multi-tensor launches. Other outputs (the logits with keep_logits, the KV cache)
stay in the pool: reading one after the next step raises torch's error, which names the fix (clone it).
"""

import operator

import torch
from torch.fx import GraphModule


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
    return _route(forward, scalars) + _route(backward, copied)


def _outputs(gm):
    return list(gm.graph.output_node().args[0])


def _is_scalar(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _route(gm, indices) -> int:
    """Replace the outputs at indices by their copies, made by one graphopt::copy_out_of_graph_pool call."""
    if not indices:
        return 0
    output = gm.graph.output_node()
    values = _outputs(gm)
    sources = [values[i] for i in indices]
    with gm.graph.inserting_before(output):
        copies = gm.graph.call_function(torch.ops.graphopt.copy_out_of_graph_pool.default, (sources,))
        copies.meta["val"] = [s.meta["val"] for s in sources]
        for k, (i, source) in enumerate(zip(indices, sources)):
            item = gm.graph.call_function(operator.getitem, (copies, k))
            item.meta = dict(source.meta)
            values[i] = item
    output.args = (type(output.args[0])(values),) + tuple(output.args[1:])
    gm.recompile()
    return len(indices)
