"""lm_head + cross-entropy → graphopt::linear_cross_entropy, which never holds the [tokens × vocab] logits at once.

Matches (after passes/normalize.py) HF's causal-LM loss on top of its lm_head:
  logits = linear(h, W[, b])  [→ logits / s or logits · s, Granite's and Cohere's logit scale]
                              [→ c·tanh(logits / c), Gemma-2's final softcapping]        (the model's logits)
  → [.to(float32)] → .view(-1, V) → F.cross_entropy(·, target, ignore_index=i, reduction="mean" | "sum")
A logit scale that is a power of two moves onto h, where it is exact (scaling by 2^n rounds nothing, in the
matmul's inputs as in its output); another scale stays unfused with a miss.
HF's gradient-accumulation form (a "sum" divided by num_items_in_batch) keeps its division in the graph.
The logits node itself may also be a graph output: with keep_logits it stays computed as before, otherwise
passes/drop_logits.py removes it. Every F.cross_entropy is a candidate; one that does not match in full (class
weights, label smoothing, reduction="none", a loss not on an lm_head, low-precision logits) stays unfused with a
miss record.
"""

import inspect
import math
import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt.passes.describe import record_for
from graphopt.passes.match import (FUSABLE_DTYPES, autocast_dtype, autocast_regions, is_call, is_cast, is_scalar,
                                   is_tensor, value)
from graphopt.passes.rewrite import Miss, erase_unused

PATTERN = "linear_cross_entropy"
_LINEAR = (torch._C._nn.linear, F.linear)
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
# Rows per chunk: the chunk's fp32 logits take at most this many bytes (its gradient as many again).
LOGITS_CHUNK_BYTES = 256 * 2**20
# Marks a logits node whose loss was fused with gradients (training): passes/drop_logits.py may drop it.
FUSED_LOSS_TAG = "graphopt_fused_loss_logits"


def _scaled(node: Node):
    """(x, s) for x / c (s = 1 / c) or x · c (s = c) with a constant c; None for any other node."""
    if not (isinstance(node, Node) and len(node.args) == 2 and not node.kwargs):
        return None
    a, b = node.args
    if is_call(node, torch.div) and is_tensor(a) and is_scalar(b) and b != 0:
        return a, 1.0 / b
    if is_call(node, torch.mul) and is_scalar(a) != is_scalar(b):
        return (b, float(a)) if is_scalar(a) else (a, float(b))
    return None


def logits_producer(logits: Node):
    """(lm_head linear node, the logit scale s or 1.0, softcap c or 0.0, nodes from logits back to the linear) for
    HF's logits; Miss if the logits are not a linear projection, optionally scaled, then optionally softcapped."""
    softcap, scale, nodes, node = 0.0, 1.0, [], logits
    if is_call(node, torch.mul) and len(node.args) == 2 and is_call(node.args[0], torch.tanh) and is_scalar(
            node.args[1]):
        tanh = node.args[0]
        div = tanh.args[0]
        if not (is_call(div, torch.div) and len(div.args) == 2 and not div.kwargs and div.args[1] == node.args[1]
                and len(tanh.users) == 1 and len(div.users) == 1 and node.args[1] > 0):
            raise Miss("the logits are scaled by a tanh that is not c·tanh(x / c) softcapping")
        softcap, nodes, node = float(node.args[1]), [node, tanh], div.args[0]
        nodes.append(div)
    scaled = _scaled(node) if not is_call(node, *_LINEAR) else None
    if scaled is not None and is_call(scaled[0], *_LINEAR):
        if nodes and len(node.users) != 1:
            raise Miss("the scaled logits are used before softcapping")
        (node, scale), nodes = scaled, nodes + [node]
        if math.frexp(scale)[0] != 0.5:
            raise Miss(f"the logits are scaled by {scale:g}, not a power of two: the fused op would scale the "
                       "hidden states instead, which rounds differently")
    if not is_call(node, *_LINEAR):
        raise Miss("the loss is not computed from a linear projection (lm_head) of hidden states")
    if nodes and len(node.users) != 1:
        raise Miss("the lm_head output is used before its scaling or softcapping")
    return node, scale, softcap, nodes + [node]


def _loss_arguments(ce: Node) -> dict:
    try:
        bound = _CROSS_ENTROPY.bind(*ce.args, **ce.kwargs)
    except TypeError as error:
        raise Miss(f"unexpected cross_entropy arguments ({error})")
    bound.apply_defaults()
    args = bound.arguments
    if args["weight"] is not None:
        raise Miss("class weights (weight=…) are not fused")
    if args["size_average"] is not None or args["reduce"] is not None:
        raise Miss("the deprecated size_average/reduce arguments are not fused; use reduction=")
    if args["label_smoothing"] != 0.0:
        raise Miss(f"label_smoothing={args['label_smoothing']} is not fused")
    if args["reduction"] not in ("mean", "sum"):
        raise Miss(f"reduction={args['reduction']!r}: only 'mean' and 'sum' are fused")
    if not isinstance(args["ignore_index"], int):
        raise Miss("ignore_index is not a constant integer")
    return args


def _match(ce: Node, autocast_regions: dict):
    args = _loss_arguments(ce)
    scores, target = args["input"], args["target"]
    if not (is_tensor(scores) and is_tensor(target)) or value(scores).dim() != 2 or value(target).dim() != 1:
        raise Miss("the loss input is not [tokens, vocab] rows with one target per row")
    if value(target).dtype != torch.long:
        raise Miss(f"targets of dtype {value(target).dtype} (class probabilities?) are not fused")
    if value(scores).dtype != torch.float32:
        raise Miss(f"cross-entropy on {value(scores).dtype} logits: the fused op computes in float32, which "
                   "would change the numbers; HF upcasts with logits.float()")

    chain, node = [], scores
    if isinstance(node, Node) and node.op == "call_method" and node.target in ("view", "reshape"):
        chain, node = [node], node.args[0]
    if is_cast(node):
        chain, node = chain + [node], node.args[0]
    if any(len(n.users) != 1 for n in chain):
        raise Miss("the flattened or upcast logits are also used outside the loss")
    lm_head, scale, softcap, producers = logits_producer(node)

    hidden, weight, bias = (list(lm_head.args) + [lm_head.kwargs.get("bias")] * 3)[:3]
    h, w, rows = value(hidden), value(weight), value(scores).shape[0]
    # under autocast both are cast to its dtype, by autocast's linear in eager and by the op's autocast rule here
    cast = autocast_dtype(autocast_regions[lm_head], h.device.type)
    if h.dtype not in FUSABLE_DTYPES or w.dtype not in FUSABLE_DTYPES or (h.dtype != w.dtype and cast is None):
        raise Miss(f"lm_head input {h.dtype} and weight {w.dtype} are not one float32/bfloat16/float16 dtype")
    if not statically_known_true(math.prod(h.shape[:-1]) == rows) or value(node).shape[-1] != value(scores).shape[1]:
        raise Miss("the loss rows are not the lm_head's rows flattened in order")
    if bias is not None and value(bias).requires_grad:
        raise Miss("the lm_head bias trains; the fused op keeps it frozen")
    if bias is not None and scale != 1.0:
        raise Miss(f"the logits of an lm_head with a bias are scaled by {scale:g}: the fused op scales the hidden "
                   "states, not the bias")
    return dict(hidden=hidden, weight=weight, bias=bias, target=target, ignore_index=args["ignore_index"],
                reduction=args["reduction"], softcap=softcap, scale=scale, logits=node, lm_head=lm_head,
                dead=chain + producers, grad_hidden=h.requires_grad, grad_weight=w.requires_grad)


def fuse_linear_ce(gm: GraphModule, report) -> int:
    """Replace each matched lm_head + loss with one graphopt::linear_cross_entropy node; record fusions and misses."""
    fused = 0
    regions = autocast_regions(gm.graph)
    for ce in [n for n in gm.graph.nodes if is_call(n, F.cross_entropy)]:
        try:
            m = _match(ce, regions)
            training = m["grad_hidden"] or m["grad_weight"]
            if not training and len(m["logits"].users) > 1:
                raise Miss("no gradients (evaluation) and the logits are returned: the loss is cheapest computed "
                           "from them, unfused")
        except Miss as miss:
            report.misses.append(record_for(ce, PATTERN, str(miss)))
            continue
        record = record_for(m["lm_head"], PATTERN)
        vocab, width = value(m["weight"]).shape
        with gm.graph.inserting_before(ce):
            hidden = m["hidden"]
            if m["scale"] != 1.0:  # a power of two: exact on the hidden states as on the logits
                hidden = gm.graph.call_function(torch.mul, (hidden, m["scale"]))
                hidden.meta = dict(m["hidden"].meta, example_value=torch.empty_like(value(m["hidden"])))
            rows = gm.graph.call_method("reshape", (hidden, -1, width))
            op = gm.graph.call_function(torch.ops.graphopt.linear_cross_entropy.default, (
                rows, m["weight"], m["bias"], m["target"], m["ignore_index"], m["reduction"], m["softcap"],
                max(1, LOGITS_CHUNK_BYTES // (vocab * 4)), m["grad_hidden"], m["grad_weight"]))
            loss = gm.graph.call_function(operator.getitem, (op, 0))
        loss.meta = dict(ce.meta)
        ce.replace_all_uses_with(loss)
        # the flattening, the upcast, and the logits themselves when nothing else reads them
        erase_unused([ce, *m["dead"]])
        if training and m["logits"].users:  # still alive: a graph output
            m["logits"].meta[FUSED_LOSS_TAG] = True
        report.fusions.append(record)
        fused += 1
    gm.recompile()
    return fused
