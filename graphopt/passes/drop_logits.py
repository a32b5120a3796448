"""The logits policy (option keep_logits, default False): in training, a fused loss's logits are not computed.

HF returns the logits beside the loss, so they are a graph output even when nobody reads them. For each logits
node passes/fuse_linear_ce.py tagged (its loss fused with gradients), the graph output becomes a zero-cost
stand-in of the same shape and dtype (a detached broadcast view of the lm_head input), and the lm_head projection,
scaling and softcapping that only fed it are erased. The backend hands the stand-in back as
graphopt.LogitsNotMaterialized, which raises, naming keep_logits=True, on any use. Logits the graph itself reads
elsewhere stay computed.
"""

import operator

from torch.fx import GraphModule

from graphopt.passes.describe import module_path
from graphopt.passes.fuse_linear_ce import FUSED_LOSS_TAG, PATTERN, logits_producer
from graphopt.passes.match import value


def drop_logits(gm: GraphModule, report) -> list:
    """Drop the tagged logits from the graph outputs; return the output positions that now hold a stand-in."""
    output = gm.graph.output_node()
    outputs = list(output.args[0])
    positions = []
    for logits in [n for n in gm.graph.nodes if n.meta.get(FUSED_LOSS_TAG)]:
        lm_head, _, _, producers = logits_producer(logits)
        where = module_path(lm_head)
        if any(user is not output for user in logits.users):
            report.notes.append(f"{PATTERN} at {where}: logits kept, the graph also reads them")
            continue
        hidden = lm_head.args[0]
        leading = value(hidden).dim() - 1
        with gm.graph.inserting_before(output):
            first = gm.graph.call_function(operator.getitem, (hidden, (Ellipsis, slice(0, 1))))
            first.meta = dict(hidden.meta, example_value=value(hidden)[..., :1])
            # detached: an output that requires grad gets a gradient in the backward, and autograd materializes
            # the unused one as zeros of the logits' full shape (2 GiB at the 1B shape's batch)
            first = gm.graph.call_method("detach", (first,))
            first.meta = dict(hidden.meta, example_value=first.args[0].meta["example_value"].detach())
            shape = (*[-1] * leading, value(logits).shape[-1])
            stand_in = gm.graph.call_method("expand", (first, *shape))
            stand_in.meta = dict(logits.meta, example_value=first.meta["example_value"].expand(*shape))
        here = [i for i, node in enumerate(outputs) if node is logits]
        for i in here:
            outputs[i] = stand_in
        output.args = (tuple(outputs),)
        for node in producers:
            if not node.users:
                gm.graph.erase_node(node)
        positions += here
        report.notes.append(f"{PATTERN} at {where}: logits not materialized (keep_logits=False); "
                            "reading outputs.logits raises")
    gm.recompile()
    return positions
