"""HF gradient checkpointing → graphopt's own per-layer memory plan.

With `gradient_checkpointing_enable(use_reentrant=False)` (what `TrainingArguments(gradient_checkpointing=True)`
does), Dynamo hands each checkpointed decoder layer over as one `tag_activation_checkpoint` higher-order op whose
body is a subgraph. The fusion passes read the top-level graph, so they would find none of the layer's norms,
rotations, gated activations or LoRA linears inside it. The bodies are inlined into the graph instead, and what the
checkpointing asks for — keep each layer's input, recompute the layer in its backward — is what memory_budget=0
plans (passes/recompute.py: per-layer checkpointing at the decoder layers' boundaries), so an "auto" budget becomes
0; a budget the user set stays theirs. The report's notes say which.
"""

import dataclasses
import operator

import torch
from torch.fx import GraphModule

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def inline_checkpoints(gm: GraphModule) -> int:
    """Inline every checkpointed region's body into gm; the number of regions inlined."""
    regions = list(gm.graph.find_nodes(op="call_function", target=_CHECKPOINT))
    for hop in regions:
        body_node, *operands = hop.args
        body = getattr(gm, body_node.target)
        with gm.graph.inserting_before(hop):
            env = dict(zip(body.graph.find_nodes(op="placeholder"), operands))
            outputs = gm.graph.graph_copy(body.graph, env)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for user in list(hop.users):
            if not (user.target is operator.getitem and isinstance(user.args[1], int)):
                raise NotImplementedError(f"a checkpointed region's output is read by {user.format_node()}")
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(hop)
        if not body_node.users:
            gm.graph.erase_node(body_node)
            delattr(gm, body_node.target)
    if regions:
        gm.recompile()
    return len(regions)


def checkpointing_as_plan(options, regions: int, report):
    """The options with the checkpointed regions' plan: budget 0 in place of "auto"; the report says so."""
    if options.memory_budget == "auto":
        report.notes.append(f"gradient checkpointing: {regions} checkpointed regions inlined and fused; the memory "
                            f"plan takes its place (memory_budget 0: each decoder layer's input is kept and the "
                            f"layer recomputed in its backward)")
        return dataclasses.replace(options, memory_budget=0.0)
    report.notes.append(f"gradient checkpointing: {regions} checkpointed regions inlined and fused; the memory "
                        f"plan is memory_budget={options.memory_budget:g} as set, not the checkpointing's")
    return options
