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

and two more where the mask is causal over a padded or a packed batch:

  attention_padded  attn_mask = causal & attention_mask[b, kv] (HF's padded batches: its 2-D attention_mask, a
                    graph input)                       →  graphopt::padded_attention(q, k, v, keep), k and v
                    unrepeated; on NVIDIA GPUs the flash kernels then skip the padding instead of computing it
                    under a mask (the mask makes SDPA take its slow kernels, and repeat k and v). The op's output
                    is 0 at padding queries, as HF's flash-attention path makes it: eager's value there is read
                    by no kept position, so the loss over kept tokens and every gradient are eager's.
  attention_packed  attn_mask = causal (over indices, or over position_ids) & one document (HF's packed batches
                    without padding: documents numbered from position_ids, a graph input)
                                                       →  graphopt::packed_attention(q, k, v, position_ids), k
                                                          and v unrepeated; on NVIDIA GPUs each document is one
                                                          sequence of the flash kernels.

Under a sliding window (HF's `kv > q - window`, Mistral's, Qwen2's, Gemma-3's local layers) the padded and
packed forms take it as the fused op's `window`; causal and a window alone stays SDPA (it takes no window).

Masks are read symbolically first (_read_mask): HF builds them from index aranges broadcast over [batch, head,
q, kv] and conjunctions of conditions on them, and a mask read as exactly "kv ≤ q" (and "attention_mask[b, kv]",
or "one document") is that at every size, symbolic ones included. A mask that reading does not cover falls back
to the evaluation below, at static sizes only.
"""

import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.experimental.symbolic_shapes import free_symbols, statically_known_true
from torch._subclasses.fake_tensor import unset_fake_temporarily

from graphopt.passes.describe import record_for
from graphopt.passes.match import FUSABLE_DTYPES, input_name, is_call, is_tensor, sdpa_arguments, value
from graphopt.passes.rewrite import Miss, erase_unused

_RESHAPES = ("reshape", "view")
_CPU = torch.device("cpu")


def _ancestors(node: Node) -> list:
    """node and every node it depends on, in graph order."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


_OFF_THE_CPU = ("cuda", "xpu", "npu", "mps", "meta")  # meta: graphopt explain traces there


def _on_cpu(arg):
    return _CPU if isinstance(arg, (torch.device, str)) and str(arg).startswith(_OFF_THE_CPU) else arg


def _evaluate(mask: Node) -> torch.Tensor:
    """The mask's value at the traced sizes, computed on the CPU from a copy of the nodes that build it."""
    nodes = _ancestors(mask)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if inputs:
        raise Miss(f"the mask reads graph input {input_name(inputs[0])} in a form graphopt does not read (padding "
                   f"beside another condition, or documents numbered another way): not provably causal")
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


# --- the mask read symbolically -----------------------------------------------------------------------------

_BATCH, _HEAD, _QUERY, _KEY = range(4)  # the axes of an SDPA mask
# The conditions a mask may be the conjunction of
_CAUSAL = "kv ≤ q"
_KEEP = "attention_mask[b, kv]"
_POSITIONS_CAUSAL = "position_ids[b, kv] ≤ position_ids[b, q]"
_SAME_DOCUMENT = "document[b, q] = document[b, kv]"  # documents numbered from position_ids (see _PerToken)


@dataclass(frozen=True)
class _Index:
    """arange(size) + offset, along `axis` of the mask once indexed into place (None before)."""
    size: object
    offset: object = 0
    axis: object = None


@dataclass(frozen=True)
class _PerToken:
    """A 2-D graph input of one value per token (attention_mask, or position_ids), or what HF derives from
    position_ids to number a packed row's documents (masking_utils.find_packed_sequence_indices), by `stage`:
    "input" as given; "first" its first column; "before" that minus 1; "steps" torch.diff of the input with "before"
    prepended; "starts" steps ≠ 1, where a document starts; "documents" their running count along the row.
    as_bool: converted to bool (its nonzero entries); axis: the mask axis it is indexed along as [b, q] or [b, kv]
    (None before); offset: an integer added once it is indexed into place (a sliding window's q - window)."""
    input: Node
    stage: str = "input"
    as_bool: bool = False
    axis: object = None
    offset: int = 0

    def then(self, stage):
        return _PerToken(self.input, stage)


@dataclass(frozen=True)
class _Window:
    """The condition q - kv < size (HF's sliding_window_overlay: kv > q - sliding_window), over the mask's indices
    or (positions) over position_ids[b, ·]: each query attends its `size` latest keys, itself included."""
    size: int
    positions: bool = False


@dataclass(frozen=True)
class _Condition:
    """The conjunction of these conditions, broadcast over the mask's axes."""
    terms: frozenset


def _placed(index, axis):
    return isinstance(index, _Index) and index.axis == axis and index.offset == 0


def _token_axis(index):
    """_QUERY or _KEY when index places a [B, L] tensor as [b, q] or [b, kv] of the mask; None otherwise."""
    if index == (slice(None), None, None, slice(None)):
        return _KEY
    if isinstance(index, tuple) and len(index) == 2 and _placed(index[0], _BATCH):
        return next((axis for axis in (_QUERY, _KEY) if _placed(index[1], axis)), None)
    return None


def _same_input(a, b, stage, axes):
    return (isinstance(a, _PerToken) and isinstance(b, _PerToken) and a.input is b.input and a.stage == b.stage == stage
            and not a.as_bool and not b.as_bool and {a.axis, b.axis} == axes)


def _shifted(x, by):
    """x (an index, or a per-token input placed along a mask axis) plus the integer `by`; None for anything else."""
    if isinstance(x, _Index):
        return _Index(x.size, x.offset + by, x.axis)
    if isinstance(x, _PerToken) and x.axis is not None and x.stage == "input" and not x.as_bool:
        return _PerToken(x.input, x.stage, x.as_bool, x.axis, x.offset + by)
    return None


def _key_vs_query(smaller, larger, strict):
    """The term that `smaller < larger` (strict) or `smaller ≤ larger` is, where one side is the key's index (or
    position) and the other the query's, each shifted by a constant: _CAUSAL or _POSITIONS_CAUSAL (kv ≤ q), a
    _Window (q - kv < size); None for anything else."""
    sides = (smaller, larger)
    if {getattr(x, "axis", None) for x in sides} != {_QUERY, _KEY}:
        return None
    if all(isinstance(x, _Index) for x in sides):
        positions = False
    elif all(isinstance(x, _PerToken) and x.stage == "input" and not x.as_bool for x in sides) \
            and smaller.input is larger.input:
        positions = True
    else:
        return None
    # smaller + its offset (<)≤ larger + its offset
    reach = larger.offset - smaller.offset - (1 if strict else 0)
    if smaller.axis == _KEY:  # kv ≤ q + reach
        return (_POSITIONS_CAUSAL if positions else _CAUSAL) if reach == 0 else None
    return _Window(reach + 1, positions) if reach >= 0 else None  # q - kv ≤ reach


def _read_node(node: Node, read: dict):
    """What node computes, in the terms above; Miss when it is anything else."""
    args, kwargs = map_arg((node.args, node.kwargs), lambda a: read.get(a, value(a)))
    target = node.target
    last_dim = (-1, 1)  # of a [B, L] tensor
    if node.op == "placeholder":
        v = value(node)
        if isinstance(v, torch.Tensor):
            if v.dim() != 2:
                raise Miss(f"the mask reads graph input {input_name(node)}, not a 2-D attention_mask or position_ids")
            return _PerToken(node, as_bool=v.dtype == torch.bool)
        return v  # a size
    if node.op == "call_method" and target in ("to", "bool"):
        dtype = torch.bool if target == "bool" else \
            kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
        token = args[0]
        if isinstance(token, _PerToken) and token.stage == "input" and dtype == torch.bool:
            if token.axis == _KEY:
                return _Condition(frozenset([_KEEP]))
            if token.axis is None:
                return _PerToken(token.input, as_bool=True)
        if dtype is None or (dtype == torch.bool and isinstance(args[0], _Condition)):
            return args[0]  # a move between devices
    elif node.op == "call_method" and target == "expand":
        return args[0]  # sizes checked against the attention's at the end
    elif node.op == "call_method" and target == "new_ones" and kwargs.get("dtype") == torch.bool \
            and tuple(args[1]) == ():
        return _Condition(frozenset())
    elif is_call(node, torch.arange) and len(args) == 1 and not {"start", "step", "end"} & kwargs.keys():
        return _Index(args[0])
    elif is_call(node, operator.add, torch.add, operator.sub, torch.sub) and isinstance(args[1], int) \
            and _shifted(args[0], 0) is not None:
        return _shifted(args[0], args[1] if target in (operator.add, torch.add) else -args[1])
    elif is_call(node, operator.getitem) and isinstance(args[0], _Index) and isinstance(args[1], tuple) \
            and len(args[1]) == 4 and args[1].count(None) == 3 and args[1].count(slice(None)) == 1:
        return _Index(args[0].size, args[0].offset, args[1].index(slice(None)))
    elif is_call(node, operator.getitem) and isinstance(args[0], _PerToken) and args[0].axis is None:
        token, axis = args[0], _token_axis(args[1])
        if token.stage == "input" and args[1] == (slice(None), slice(None, 1)):
            return token.then("first")
        if axis == _KEY and token.stage == "input" and token.as_bool:
            return _Condition(frozenset([_KEEP]))  # HF: attention_mask[batch_idx, kv_idx], already bool
        if axis is not None and token.stage in ("input", "documents"):
            return _PerToken(token.input, token.stage, token.as_bool, axis)
    elif is_call(node, operator.sub, torch.sub) and isinstance(args[0], _PerToken) and args[0].stage == "first" \
            and args[1] == 1:
        return args[0].then("before")
    elif is_call(node, torch.diff) and isinstance(args[0], _PerToken) and args[0].stage == "input" \
            and args[0].axis is None and len(args) == 1 and kwargs.get("n", 1) == 1 \
            and kwargs.get("dim", -1) in last_dim and isinstance(kwargs.get("prepend"), _PerToken) \
            and kwargs["prepend"].input is args[0].input and kwargs["prepend"].stage == "before" \
            and "append" not in kwargs:
        return args[0].then("steps")
    elif is_call(node, operator.ne, torch.ne) and isinstance(args[0], _PerToken) and args[0].stage == "steps" \
            and args[1] == 1:
        return args[0].then("starts")
    elif (node.op == "call_method" and target == "cumsum" or is_call(node, torch.cumsum)) \
            and isinstance(args[0], _PerToken) and args[0].stage == "starts" \
            and (args[1] if len(args) > 1 else kwargs.get("dim")) in last_dim and "dtype" not in kwargs:
        return args[0].then("documents")
    elif is_call(node, operator.le, operator.ge, operator.lt, operator.gt, torch.le, torch.ge, torch.lt, torch.gt):
        smaller, larger = args[:2] if target in (operator.le, torch.le, operator.lt, torch.lt) else args[1::-1]
        term = _key_vs_query(smaller, larger, strict=target in (operator.lt, operator.gt, torch.lt, torch.gt))
        if term is not None:  # HF ≥ 5.24 compares positions where it packs documents
            return _Condition(frozenset([term]))
    elif is_call(node, operator.eq, torch.eq) and _same_input(args[0], args[1], "documents", {_QUERY, _KEY}):
        return _Condition(frozenset([_SAME_DOCUMENT]))
    elif is_call(node, operator.and_, torch.logical_and, torch.bitwise_and) \
            and all(isinstance(a, _Condition) for a in args[:2]):
        return _Condition(args[0].terms | args[1].terms)
    elif is_call(node, torch.ones_like) and isinstance(args[0], _Condition):
        return _Condition(frozenset())
    raise Miss(f"the mask is built with {node.op} {getattr(target, '__name__', target)}, which graphopt does not "
               f"read")


def _read_mask(args: dict):
    """(the conditions the mask is the conjunction of, the 2-D graph input it reads or None), at every size; Miss
    when the mask is not made of the nodes _read_node reads or its sizes are not the attention's."""
    mask = args["attn_mask"]
    read = {}
    for node in _ancestors(mask):
        read[node] = _read_node(node, read)
    condition = read[mask]
    if not isinstance(condition, _Condition):
        raise Miss("the mask is not a condition on positions")
    indices = [v for v in read.values() if isinstance(v, _Index)]
    query, key = value(args["query"]), value(args["key"])
    sizes = {_BATCH: query.shape[0], _QUERY: query.shape[-2], _KEY: key.shape[-2]}
    for index in indices:
        if index.axis is not None and not statically_known_true(index.size == sizes.get(index.axis, -1)):
            raise Miss(f"an index of the mask spans {index.size} positions, not its axis' {sizes.get(index.axis)}")
    shape = value(mask).shape
    if len(shape) != 4 or not all(statically_known_true(shape[a] == sizes[a]) or statically_known_true(shape[a] == 1)
                                  for a in sizes):
        raise Miss(f"the mask's shape {tuple(shape)} is not the attention's")
    if not statically_known_true(sizes[_QUERY] == sizes[_KEY]):
        raise Miss("queries and keys differ in length (a KV cache): causal from position 0 does not hold")
    inputs = {v.input for v in read.values() if isinstance(v, _PerToken)}
    return condition.terms, next(iter(inputs)) if len(inputs) == 1 else None


def _mask_kind(args: dict):
    """(kind, the 2-D input, window) where the mask is proven so; Miss otherwise. kind: "causal" (no input),
    "padded" (the attention_mask input) or "packed" (the position_ids input); window: the sliding window's size, or
    None.

    Packed: within one document positions go up by 1 a token (that is where _PerToken's documents break), so
    "position_ids[b, kv] ≤ position_ids[b, q]" is "kv ≤ q" there (and a window over positions one over indices),
    and a document is one run of tokens (its number is a running count of starts): the mask is causal attention
    within each run, packed_attention's definition."""
    if args.get("is_causal", False):
        raise Miss("both a mask and is_causal are given")
    if not isinstance(args["attn_mask"], Node):
        raise Miss("the mask is a constant, not a node")
    try:
        terms, tokens = _read_mask(args)
    except Miss as unread:
        if free_symbols(value(args["attn_mask"])) or free_symbols(value(args["query"])):
            raise Miss(f"{unread}; with symbolic sizes (dynamic shapes) evaluating it proves nothing") from None
        _check_causal(args)  # the mask as it evaluates at these sizes
        return "causal", None, None
    windows = {t for t in terms if isinstance(t, _Window)}
    terms -= windows
    window = min(w.size for w in windows) if windows else None  # two windows: the narrower holds both
    if window is not None and statically_known_true(value(args["query"]).shape[-2] <= window):
        window = None  # as wide as the sequence: it excludes nothing
    if terms == {_CAUSAL} and window is None:
        return "causal", None, None
    if terms == {_CAUSAL, _KEEP} and tokens is not None and not any(w.positions for w in windows):
        return "padded", tokens, window
    if terms in ({_CAUSAL, _SAME_DOCUMENT}, {_POSITIONS_CAUSAL, _SAME_DOCUMENT}) and tokens is not None:
        return "packed", tokens, window
    if terms == {_CAUSAL} and window is not None:
        raise Miss(f"a sliding window ({window} tokens) over an unpadded batch: SDPA takes no window, and the fused "
                   f"ops fuse it where the batch comes with an attention_mask or position_ids")
    raise Miss("the mask is not the causal lower triangle (padding, a sliding window or a prefix)"
               if not {_CAUSAL, _POSITIONS_CAUSAL} & terms else
               f"the mask adds conditions to causal that graphopt does not fuse ({', '.join(sorted(map(str, terms)))})")


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


def _unrepeated(args: dict):
    """(key, value) without repeat_kv's copies when both are repeated alike; None when neither is repeated."""
    key, val = _repeated(args["key"]), _repeated(args["value"])
    if key is None and val is None:
        return None
    if key is None or val is None:
        raise Miss("only one of key and value is repeated to the query heads")
    if not statically_known_true(key[1] == val[1]):
        raise Miss("key and value are repeated by different factors")
    return key[0], val[0]


def _gqa(args: dict):
    """(key, value) for SDPA's enable_gqa, when repeat_kv's copies can go; None when neither is repeated."""
    unrepeated = _unrepeated(args)
    if unrepeated is None:
        return None
    if args.get("attn_mask") is not None:
        raise Miss("a mask is given: SDPA's fused GQA kernels take none, so k and v stay repeated")
    if args.get("enable_gqa", False):
        raise Miss("enable_gqa is already set on repeated key and value")
    return unrepeated


def rewrite_attention(gm: GraphModule, report) -> int:
    """Rewrite each SDPA call's mask and repeated k/v as above; record each rewrite and each miss."""
    rewritten = 0
    kinds = {}  # (mask, lengths) → (kind, 2-D input) or why it is none (one mask serves every layer)
    tokens = {}  # (2-D input, device) → what the fused op reads of it, shared by the layers
    for sdpa in [n for n in gm.graph.nodes if is_call(n, F.scaled_dot_product_attention)]:
        args = sdpa_arguments(sdpa)
        if not all(isinstance(args.get(k), Node) for k in ("query", "key", "value")):
            continue
        dropped = []
        mask = args.get("attn_mask")
        if mask is not None:
            key = (mask, str(value(args["query"]).shape[-2]), str(value(args["key"]).shape[-2]))
            if key not in kinds:
                try:
                    kinds[key] = _mask_kind(args)
                except Miss as miss:
                    kinds[key] = str(miss)
            if kinds[key] == ("causal", None, None):
                dropped.append(mask)
                args["attn_mask"], args["is_causal"] = None, True
                report.fusions.append(record_for(sdpa, "attention_causal"))
                rewritten += 1
            elif isinstance(kinds[key], tuple):
                kind, per_token, window = kinds[key]
                try:
                    _masked_attention(sdpa, args, kind, per_token, window, tokens)
                    report.fusions.append(record_for(sdpa, f"attention_{kind}"))
                    rewritten += 1
                    continue
                except Miss as miss:
                    report.misses.append(record_for(sdpa, f"attention_{kind}", str(miss)))
            else:
                report.misses.append(record_for(sdpa, "attention_causal", kinds[key]))
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
            erase_unused(dropped, inputs=True)
    gm.recompile()
    return rewritten


def _masked_attention(sdpa: Node, args: dict, kind: str, per_token: Node, window, tokens: dict) -> None:
    """Replace sdpa by graphopt::padded_attention (kind "padded": its mask is causal & (attention_mask != 0)) or
    graphopt::packed_attention ("packed": causal within the documents of position_ids), of unrepeated k and v,
    within a sliding window where window is not None."""
    query, key, val = args["query"], args["key"], args["value"]
    if value(args.get("dropout_p", 0.0)) != 0:
        raise Miss("attention dropout: the fused op has none")
    if args.get("enable_gqa", False):
        raise Miss("enable_gqa is set on a masked call")
    q = value(query)
    if q.dim() != 4 or q.dtype not in FUSABLE_DTYPES:
        raise Miss(f"query {q.dtype} of {q.dim()} dimensions: the op takes [batch, heads, length, dim] floats")
    if not statically_known_true(value(per_token).shape[0] == q.shape[0]):
        raise Miss(f"{input_name(per_token)} has {value(per_token).shape[0]} rows for a batch of {q.shape[0]}")
    key, val = _unrepeated(args) or (key, val)
    scale = args.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    graph = sdpa.graph
    op = getattr(torch.ops.graphopt, f"{kind}_attention").default
    per_token = _on_device(per_token, kind == "padded", q.device, tokens)
    with graph.inserting_before(sdpa):
        fused = graph.call_function(op, (query, key, val, per_token, scale, window))
        out = graph.call_function(operator.getitem, (fused, 0))
    outputs = op(value(query), value(key), value(val), value(per_token), value(scale), window)
    fused.meta = dict(sdpa.meta, example_value=outputs)
    out.meta = dict(sdpa.meta, example_value=outputs[0])
    sdpa.replace_all_uses_with(out)
    erase_unused([sdpa, args.get("attn_mask"), args["key"], args["value"]], inputs=True)


def _on_device(per_token: Node, as_keep: bool, device, tokens: dict) -> Node:
    """The 2-D input on the attention's device, as keep (attention_mask != 0, bool) or as it is (position_ids),
    computed once after the input: every layer reads the same node."""
    if (per_token, str(device)) not in tokens:
        graph, example = per_token.graph, value(per_token)
        dtype = torch.bool if as_keep else example.dtype
        source = per_token
        if as_keep:
            with graph.inserting_after(per_token):
                source = graph.call_function(torch.ne, (per_token, 0))
            source.meta = dict(per_token.meta, example_value=torch.empty_like(example, dtype=dtype))
        with graph.inserting_after(source):
            moved = graph.call_method("to", (source,), {"device": device})
        moved.meta = dict(per_token.meta, example_value=torch.empty_like(example, dtype=dtype, device=device))
        tokens[(per_token, str(device))] = moved
    return tokens[(per_token, str(device))]
