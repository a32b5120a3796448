"""Rotary position embedding of q and k → graphopt::rope.

Matches (after passes/normalize.py) HF's apply_rotary_pos_emb as Dynamo hands it over in Llama, Qwen2, Mistral,
Gemma and Phi-3, for q and k of shape [B, H, S, D] (transposed views of the projections):
  c = cos.unsqueeze(1); s = sin.unsqueeze(1)                     cos, sin: [B or 1, S, R], no gradient
  x * c + cat((neg(x[..., R/2:]), x[..., :R/2]), -1) * s          rotate_half is two slices, a neg and a cat
  Phi-3 partial rotary (R < D): x = q[..., :R], and the result is cat([·, q[..., R:]], -1)
  GPT-OSS: x1, x2 = chunk(x, 2, -1); cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)   cos, sin: [B or 1, S, R/2]
    the same rotation with cos and sin given once for both halves: the op gets them repeated, cat((c, c), -1)
The q and k rotations of one attention module that share cos and sin become one node. Every rotate_half (a cat
of the negated upper and the lower slice of one tensor) is a candidate: one that does not match in full, or is
left without a partner, stays unfused with a miss record, and so does every interleaved rotate_half (a stack of
the negated odd and the even features, flattened). GPT-OSS's form is a candidate only once it matches in full.
"""

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt.passes.describe import module_path, operation, record_for
from graphopt.passes.match import FUSABLE_DTYPES, is_call, is_tensor, only_user, other_operand, same_shape, value
from graphopt.passes.rewrite import Miss, check_only_inside, erase_unused

PATTERN = "rope"
INTERLEAVED = ("interleaved rotary (adjacent features paired, as Cohere, GLM and Helium rotate) is not fused: "
               "graphopt::rope pairs the two halves of the rotary dim")


def _last_dim_slice(node, step=1):
    """(base, start, stop) when node is base[..., start:stop:step] with constant bounds; else None."""
    if not is_call(node, operator.getitem) or not is_tensor(node.args[0]):
        return None
    base, index = node.args
    width, ndim = value(base).shape[-1], value(base).dim()
    if not (isinstance(index, tuple) and index and isinstance(index[-1], slice) and isinstance(width, int)):
        return None
    lead, last = index[:-1], index[-1]
    if lead != (Ellipsis,) and lead != (slice(None),) * (ndim - 1):
        return None
    start, stop = last.start or 0, width if last.stop is None else last.stop
    if (last.step or 1) != step or not (isinstance(start, int) and isinstance(stop, int)):
        return None
    start, stop = (i + width if i < 0 else i for i in (start, stop))
    return base, start, min(stop, width)


def _rotate_half_input(cat: Node):
    """x for a cat((neg(x[..., a:]), x[..., :b]), -1), the shape rotate_half takes; None for any other cat."""
    tensors = cat.args[0] if cat.args else None
    if not isinstance(tensors, (tuple, list)) or len(tensors) != 2 or not is_call(tensors[0], torch.neg):
        return None
    upper, lower = _last_dim_slice(tensors[0].args[0]), _last_dim_slice(tensors[1])
    if upper is None or lower is None or upper[0] is not lower[0]:
        return None
    return upper[0]


def _interleaved_rotation(flat: Node) -> bool:
    """Whether flat is stack((neg(x[..., 1::2]), x[..., ::2]), -1).flatten(-2): the rotate_half of interleaved
    rotary (GPT-J's, which Cohere, GLM and Helium use), pairing adjacent features instead of the two halves."""
    if not (isinstance(flat, Node) and flat.op == "call_method" and flat.target == "flatten"
            and flat.args[1:] in ((-2,), (-2, -1))):
        return False
    stack = flat.args[0]
    tensors = stack.args[0] if is_call(stack, torch.stack) and stack.args else None
    if not (isinstance(tensors, (tuple, list)) and len(tensors) == 2 and is_call(tensors[0], torch.neg)
            and _dim(stack) in (-1, value(stack).dim() - 1)):
        return False
    odd, even = _last_dim_slice(tensors[0].args[0], step=2), _last_dim_slice(tensors[1], step=2)
    return odd is not None and even is not None and odd[0] is even[0] and (odd[1], even[1]) == (1, 0)


def _dim(cat: Node):
    return cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)


def _unsqueezed(node):
    """t for t.unsqueeze(1) of a 3-D t (HF's cos/sin broadcast over heads); None for anything else."""
    if not (isinstance(node, Node) and (node.op == "call_method" and node.target == "unsqueeze"
                                        or is_call(node, torch.unsqueeze))):
        return None
    source = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return source if is_tensor(source) and value(source).dim() == 3 and dim in (1, -3) else None


def _single_user(node: Node):
    """The one user of an intermediate of the rotation (None if it has none); Miss if others read it too."""
    if len(node.users) > 1:
        raise Miss(f"an intermediate of the rotation ({operation(node)}) is also read outside it, by "
                   f"{', '.join(operation(u) for u in node.users)}")
    return only_user(node)


@dataclass
class Rotation:
    """One matched x·cos + rotate_half(x)·sin."""

    x: Node  # the op's input: q or k
    cos: Node  # [B or 1, S, R], before HF's unsqueeze; [B or 1, S, R/2] when halved
    sin: Node
    end: Node  # the rotated output
    nodes: list  # what the op replaces
    unsqueezed: tuple  # HF's cos/sin unsqueezed over heads, shared with the partner: erased once unused
    halved: bool = False  # GPT-OSS's cos/sin, one half of the op's


def _chunk_halves(first: Node, second: Node):
    """x when first, second are chunk(x, 2, -1)[0] and [1]; else None."""
    if not all(is_call(n, operator.getitem) and n.args[1] == i for i, n in enumerate((first, second))):
        return None
    chunk = first.args[0]
    if chunk is not second.args[0] or not is_call(chunk, torch.chunk) or not is_tensor(chunk.args[0]):
        return None
    arguments = dict(zip(("input", "chunks", "dim"), chunk.args), **chunk.kwargs)
    x = chunk.args[0]
    last = arguments.get("chunks") == 2 and arguments.get("dim", 0) in (-1, value(x).dim() - 1)
    return x if last and value(x).shape[-1] % 2 == 0 else None


def _products(node: Node, combine):
    """(a, b, c, d) for combine(a * b, c * d) (torch.mul's operands as written); else None."""
    if not (is_call(node, combine) and len(node.args) == 2 and not node.kwargs):
        return None
    left, right = node.args
    if not (is_call(left, torch.mul) and is_call(right, torch.mul) and len(left.args) == len(right.args) == 2):
        return None
    return (*left.args, *right.args)


def _match_halved(cat: Node):
    """GPT-OSS's rotation, cat((x1 * c - x2 * s, x2 * c + x1 * s), -1) with x1, x2 = chunk(x, 2, -1), as a
    Rotation; None when cat is not that."""
    tensors = cat.args[0] if cat.args else None
    if not (isinstance(tensors, (tuple, list)) and len(tensors) == 2 and _dim(cat) in (-1, value(cat).dim() - 1)):
        return None
    first, second = _products(tensors[0], torch.sub), _products(tensors[1], torch.add)
    if first is None or second is None:
        return None
    x1, cos4, x2, sin4 = first
    x = _chunk_halves(x1, x2) if second == (x2, cos4, x1, sin4) else None
    if x is None:
        return None
    nodes = [x1.args[0], x1, x2, *tensors, *(product.args[i] for product in tensors for i in (0, 1)), cat]
    check_only_inside(nodes, cat, "rotation")
    cos, sin = _unsqueezed(cos4), _unsqueezed(sin4)
    _check(x, cos, sin, cat, value(x).shape[-1] // 2)
    return Rotation(x, cos, sin, cat, nodes, (cos4, sin4), halved=True)


def _match(cat: Node) -> Rotation:
    x = _rotate_half_input(cat)
    neg, lower = cat.args[0]
    upper = neg.args[0]
    _, up_start, up_stop = _last_dim_slice(upper)
    _, low_start, low_stop = _last_dim_slice(lower)
    rot = value(x).shape[-1]
    if _dim(cat) not in (-1, value(cat).dim() - 1) or not (low_start == 0 and low_stop == up_start == rot // 2
                                                           and up_stop == rot and rot % 2 == 0):
        raise Miss("the cat of a negated slice and a slice is not rotate_half (halves swapped along the last dim)")
    mul_sin = _single_user(cat)
    sin4 = other_operand(mul_sin, cat) if is_call(mul_sin, torch.mul) else None
    add = _single_user(mul_sin) if sin4 is not None else None
    mul_cos = other_operand(add, mul_sin) if is_call(add, torch.add) else None
    cos4 = other_operand(mul_cos, x) if is_call(mul_cos, torch.mul) else None
    if cos4 is None or not isinstance(sin4, Node):
        raise Miss("rotate_half(x) is not used as x * cos + rotate_half(x) * sin")
    nodes = [upper, neg, lower, cat, mul_sin, mul_cos, add]
    x, end = _partial_rotary(x, add, nodes)
    check_only_inside(nodes, end, "rotation")
    cos, sin = _unsqueezed(cos4), _unsqueezed(sin4)
    _check(x, cos, sin, end, rot)
    return Rotation(x, cos, sin, end, nodes, (cos4, sin4))


def _partial_rotary(x: Node, add: Node, nodes):
    """Phi-3: x = q[..., :R] and the rotation is cat([·, q[..., R:]], -1) → (q, that cat). Otherwise (x, add):
    the rotation of x alone, whatever x is a view of."""
    rotated, joined = _last_dim_slice(x), only_user(add)
    tensors = joined.args[0] if is_call(joined, torch.cat) and joined.args else None
    if rotated is None or rotated[1] != 0 or not (isinstance(tensors, (tuple, list)) and len(tensors) == 2
                                                  and tensors[0] is add):
        return x, add
    q, _, rot = rotated
    rest = _last_dim_slice(tensors[1])
    if rest is None or rest != (q, rot, value(q).shape[-1]) or _dim(joined) not in (-1, value(joined).dim() - 1):
        return x, add
    nodes += [x, tensors[1], joined]
    return q, joined


def _check(x: Node, cos, sin, end: Node, width):
    """Miss unless x is [B, H, S, D] and cos, sin [B or 1, S, width] tensors that broadcast over it without a
    gradient, in dtypes the op takes."""
    q, out = value(x), value(end)
    if q.dim() != 4:
        raise Miss(f"the rotated tensor has shape {list(q.shape)}, not [batch, heads, seq, head_dim]")
    if cos is None or sin is None:
        raise Miss("cos/sin are not [batch or 1, seq, rotary_dim] tensors unsqueezed at dim 1 (HF's layout for q "
                   "of [batch, heads, seq, head_dim]; q laid out [batch, seq, heads, head_dim] is not fused)")
    c, s = value(cos), value(sin)
    if not (statically_known_true(c.shape[0] == 1) or statically_known_true(c.shape[0] == q.shape[0])) or not (
            statically_known_true(c.shape[1] == q.shape[2]) and statically_known_true(c.shape[2] == width)
            and same_shape(c, s)):
        raise Miss(f"cos/sin {list(c.shape)} do not broadcast as [batch or 1, seq, {width}] over q {list(q.shape)}")
    if c.requires_grad or s.requires_grad:
        raise Miss("cos/sin require grad: the fused op gives them no gradient")
    if q.dtype not in FUSABLE_DTYPES or c.dtype not in FUSABLE_DTYPES or c.dtype != s.dtype:
        raise Miss(f"q/k {q.dtype}, cos {c.dtype}, sin {s.dtype}: not float32/bfloat16/float16 with one cos/sin dtype")
    if out.dtype != torch.promote_types(q.dtype, c.dtype):
        raise Miss(f"the {q.dtype} rotation by {c.dtype} cos/sin gives {out.dtype}, not their promoted dtype")


def _pairs(gm: GraphModule, rotations, report):
    """The rotations of one attention module sharing cos/sin, two by two in graph order; a lone one is a miss."""
    groups = defaultdict(list)
    for r in rotations:
        groups[(r.cos, r.sin, module_path(r.end))].append(r)
    order = _position(gm.graph)
    for group in groups.values():
        group.sort(key=lambda r: order(r.end))
        if len(group) % 2:
            lone = group.pop()
            report.misses.append(record_for(lone.end, PATTERN, "a lone q or k rotation: no second rotation in its "
                                            "module shares its cos/sin (the op rotates q and k together)"))
        for a, b in zip(group[::2], group[1::2]):
            if order(b.x) > order(a.end):
                reason = "k's input is computed after q's rotation is used, so no one node can take both"
                report.misses += [record_for(r.end, PATTERN, reason) for r in (a, b)]
            elif not all(statically_known_true(value(a.x).shape[i] == value(b.x).shape[i]) for i in (0, 2, 3)):
                reason = "q and k differ in batch, seq or head_dim"
                report.misses += [record_for(r.end, PATTERN, reason) for r in (a, b)]
            else:
                yield a, b


def _cast(gm: GraphModule, x: Node, dtype: torch.dtype) -> Node:
    if value(x).dtype == dtype:
        return x
    cast = gm.graph.call_method("to", (x, dtype))
    cast.meta = dict(x.meta, example_value=torch.empty_like(value(x), dtype=dtype))
    return cast


def _repeated(gm: GraphModule, half: Node) -> Node:
    """cat((half, half), -1): GPT-OSS's cos or sin in HF's layout, where both halves of the rotary dim read it."""
    full = gm.graph.call_function(torch.cat, ((half, half), -1))
    full.meta = dict(half.meta, example_value=torch.cat((value(half), value(half)), -1))
    return full


def _contiguous(fake):
    return torch.empty_like(fake, memory_format=torch.contiguous_format)


def fuse_rope(gm: GraphModule, report) -> int:
    """Replace each q/k pair of rotations with one graphopt::rope node; record fusions and misses."""
    rotations = []
    report.misses += [record_for(n, PATTERN, INTERLEAVED) for n in gm.graph.nodes if _interleaved_rotation(n)]
    for cat in [n for n in gm.graph.nodes if is_call(n, torch.cat)]:
        try:
            if _rotate_half_input(cat) is not None:
                rotations.append(_match(cat))
            elif (halved := _match_halved(cat)) is not None:
                rotations.append(halved)
        except Miss as miss:
            report.misses.append(record_for(cat, PATTERN, str(miss)))
    fused = 0
    for q, k in list(_pairs(gm, rotations, report)):
        with gm.graph.inserting_before(q.end):
            # cos/sin of a wider dtype promote the rotation (fp32 cos/sin on bf16 q under autocast): the op, which
            # keeps q's dtype, gets q and k cast up, so it computes and returns what eager's promotion does
            xs = [_cast(gm, r.x, value(r.end).dtype) for r in (q, k)]
            cos, sin = (_repeated(gm, t) if q.halved else t for t in (q.cos, q.sin))
            op = gm.graph.call_function(torch.ops.graphopt.rope.default, (*xs, cos, sin))
            outputs = [gm.graph.call_function(operator.getitem, (op, i)) for i in range(2)]
        op.meta = dict(q.end.meta, example_value=tuple(_contiguous(value(r.end)) for r in (q, k)))
        for r, out in zip((q, k), outputs):
            out.meta = dict(r.end.meta, example_value=_contiguous(value(r.end)))
            r.end.replace_all_uses_with(out)
        # with HF's unsqueezes of cos/sin, once per layer for q and k
        erase_unused([*q.nodes, *k.nodes, *q.unsqueezed, *k.unsqueezed])
        report.fusions.append(record_for(outputs[0], PATTERN))
        fused += 1
    gm.recompile()
    return fused


def _position(graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
