"""Scaled dot-product attention in the form its fast kernels take: is_causal instead of a mask tensor, GQA without
copies of k and v.

Some transformers versions (5.17 among them, under torch.compile before torch 2.14) hand SDPA a causal mask built
from aranges instead of is_causal=True, and then repeat k and v to every query head (repeat_kv), because SDPA's
GQA path is only taken without a mask. On the H200 that made attention 2.4x slower at the Llama-3.2-1B shape (the
kernel computes the masked half and reads the mask) and saved 32-head copies of k and v for the backward
(benchmarks/RESULTS.md). Two rewrites of each F.scaled_dot_product_attention call:

  attention_causal  attn_mask built from sizes and constants only (no graph input), square, and at the traced
                    sizes equal to the lower triangle (bool True, or float 0, where attending; bool False, or
                    float -inf / the dtype's lowest, elsewhere)             →  attn_mask=None, is_causal=True
                    Proof by evaluation: the graph is specialized to these sizes, so equality here is equality.
                    A mask whose sizes are symbolic (dynamic shapes) could differ at other sizes (a sliding
                    window wider than the traced sequence looks causal): it stays, with a miss record.
  attention_gqa     key and value as HF's repeat_kv makes them: x[:, :, None].expand(b, h, n, s, d).reshape(b,
                    h * n, s, d)                                            →  x itself, enable_gqa=True
                    (SDPA's GQA maps query head i to kv head i // n, the same head repeat_kv copies there.)
"""

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_symbols, statically_known_true
from torch._subclasses.fake_tensor import unset_fake_temporarily

from graphopt.passes.match import is_call, is_tensor, sdpa_arguments, value
from graphopt.report import record_for

_RESHAPES = ("reshape", "view")
_CPU = torch.device("cpu")


class Miss(Exception):
    """The rewrite cannot be proven to compute the same attention; the message says why."""


def _ancestors(node: Node) -> list:
    """node and every node it depends on, in graph order."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _on_cpu(arg):
    return _CPU if isinstance(arg, (torch.device, str)) and str(arg).startswith(("cuda", "xpu", "npu", "mps")) \
        else arg


def _evaluate(mask: Node) -> torch.Tensor:
    """The mask's value at the traced sizes, computed on the CPU from a copy of the nodes that build it."""
    nodes = _ancestors(mask)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if inputs:
        raise Miss(f"the mask reads graph input {inputs[0].name} (a padding mask?): not provably causal")
    if free_symbols(value(mask)):
        raise Miss("the mask's sizes are symbolic (dynamic shapes): causal at the traced length does not prove "
                   "causal at every length")
    graph = torch.fx.Graph()
    copies = {}
    for n in nodes:
        if n.op not in ("call_function", "call_method"):
            raise Miss(f"the mask is built with {n.op} {n.target}")
        copies[n] = graph.node_copy(n, lambda a: copies[a])
        copies[n].args = tuple(_on_cpu(a) for a in copies[n].args)
        copies[n].kwargs = {k: _on_cpu(a) for k, a in copies[n].kwargs.items()}
    graph.output(copies[mask])
    with unset_fake_temporarily():
        try:
            return GraphModule(torch.nn.Module(), graph)()
        except Exception as error:  # an op the copy cannot run on the CPU: not provable here
            raise Miss(f"the mask could not be evaluated ({type(error).__name__}: {error})") from error


def _is_causal(mask: torch.Tensor, query_length: int, key_length: int) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or query_length != key_length:
        return False
    if tuple(mask.shape[-2:]) != (query_length, key_length):
        return False
    attend = torch.ones(query_length, key_length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == attend).all())
    if not mask.is_floating_point():
        return False
    lowest = torch.finfo(mask.dtype).min
    masked = (mask == float("-inf")) | (mask == lowest)
    return bool(((mask == 0) == attend).all() and (masked == ~attend).all())


def _causal_proof(args: dict):
    """None when the attn_mask can be replaced by is_causal=True, else the reason it cannot."""
    try:
        _check_causal(args)
    except Miss as miss:
        return str(miss)
    return None


def _check_causal(args: dict) -> None:
    mask = args["attn_mask"]
    if args.get("is_causal", False):
        raise Miss("both a mask and is_causal are given")
    if not isinstance(mask, Node):
        raise Miss("the mask is a constant, not a node")
    query, key = value(args["query"]), value(args["key"])
    query_length, key_length = query.shape[-2], key.shape[-2]
    if not (isinstance(query_length, int) and isinstance(key_length, int)):
        raise Miss("the sequence length is symbolic (dynamic shapes): causal at the traced length does not prove "
                   "causal at every length")
    if not _is_causal(_evaluate(mask), query_length, key_length):
        raise Miss("the mask is not the causal lower triangle (padding, a sliding window or a prefix)")


def _repeated(node: Node):
    """(x, n) when node is HF's repeat_kv(x, n) of x [b, h, s, d]: x[:, :, None].expand(b, h, n, s, d).reshape(b,
    h * n, s, d); None otherwise."""
    if not (isinstance(node, Node) and node.op == "call_method" and node.target in _RESHAPES):
        return None
    expand = node.args[0]
    if not (isinstance(expand, Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    unsqueezed = expand.args[0]
    index = (slice(None), slice(None), None, slice(None), slice(None))
    if is_call(unsqueezed, operator.getitem) and unsqueezed.args[1] == index:
        source = unsqueezed.args[0]
    elif is_call(unsqueezed, torch.unsqueeze) and tuple(unsqueezed.args[1:]) == (2,):
        source = unsqueezed.args[0]
    elif isinstance(unsqueezed, Node) and unsqueezed.op == "call_method" and unsqueezed.target == "unsqueeze" \
            and tuple(unsqueezed.args[1:]) == (2,):
        source = unsqueezed.args[0]
    else:
        return None
    if not is_tensor(source) or value(source).dim() != 4:
        return None
    b, h, s, d = value(source).shape
    expanded, out = value(expand).shape, value(node).shape
    if len(expanded) != 5 or len(out) != 4:
        return None
    n = expanded[2]
    same = [(expanded[0], b), (expanded[1], h), (expanded[3], s), (expanded[4], d),
            (out[0], b), (out[1], h * n), (out[2], s), (out[3], d)]
    if not all(statically_known_true(x == y) for x, y in same):
        return None
    return source, n


def _gqa(args: dict):
    """(key, value) without repeat_kv's copies when both are repeated alike; None when neither is repeated."""
    key, val = _repeated(args["key"]), _repeated(args["value"])
    if key is None and val is None:
        return None
    if key is None or val is None:
        raise Miss("only one of key and value is repeated to the query heads")
    if args.get("attn_mask") is not None:
        raise Miss("a mask is given: SDPA's fused GQA kernels take none, so k and v stay repeated")
    if args.get("enable_gqa", False):
        raise Miss("enable_gqa is already set on repeated key and value")
    if not statically_known_true(key[1] == val[1]):
        raise Miss("key and value are repeated by different factors")
    return key[0], val[0]


def _erase_unused(nodes) -> None:
    """Erase the given nodes, and then their inputs, as long as nothing reads them any more."""
    erased, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op not in ("call_function", "call_method"):
            continue
        stack.extend(node.all_input_nodes)
        node.graph.erase_node(node)
        erased.add(node)


def rewrite_attention(gm: GraphModule, report) -> int:
    """Rewrite each SDPA call's mask and repeated k/v as above; record each rewrite and each miss."""
    rewritten = 0
    proofs = {}  # (mask, lengths) → None when proven causal, else why not (one mask serves every layer)
    for sdpa in [n for n in gm.graph.nodes if is_call(n, F.scaled_dot_product_attention)]:
        args = sdpa_arguments(sdpa)
        if not all(isinstance(args.get(k), Node) for k in ("query", "key", "value")):
            continue
        dropped = []
        mask = args.get("attn_mask")
        if mask is not None:
            key = (mask, str(value(args["query"]).shape[-2]), str(value(args["key"]).shape[-2]))
            if key not in proofs:
                proofs[key] = _causal_proof(args)
            if proofs[key] is None:
                dropped.append(mask)
                args["attn_mask"], args["is_causal"] = None, True
                report.fusions.append(record_for(sdpa, "attention_causal"))
                rewritten += 1
            else:
                report.misses.append(record_for(sdpa, "attention_causal", proofs[key]))
        try:
            unrepeated = _gqa(args)
            if unrepeated is not None:
                dropped += [args["key"], args["value"]]
                args["key"], args["value"] = unrepeated
                args["enable_gqa"] = True
                report.fusions.append(record_for(sdpa, "attention_gqa"))
                rewritten += 1
        except Miss as miss:
            report.misses.append(record_for(sdpa, "attention_gqa", str(miss)))
        if dropped:
            sdpa.args = (args.pop("query"), args.pop("key"), args.pop("value"))
            sdpa.kwargs = args
            _erase_unused(dropped)
    gm.recompile()
    return rewritten
