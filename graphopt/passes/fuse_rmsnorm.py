"""RMSNorm subgraph → graphopt::rms_norm.

Matches (after passes/normalize.py), in fp32/bf16/fp16 models:
  Llama, Qwen2, Mistral, Phi-3:  xf = x.to(f32); xf * rsqrt(mean(xf², -1, keepdim) + eps) → .to(dtype) → weight * ·
  Gemma:                          (xf * rsqrt(...)) * (1 + weight.to(f32)) → .to(x.dtype)
  F.rms_norm / torch.rms_norm over the last dimension.
Every rsqrt and every module whose class name says RMSNorm is a candidate: a candidate that does not match
in full is left unfused and reported as a miss with the reason.
"""

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import guard_float, statically_known_true

from graphopt.passes.describe import module_class, module_path, record_for
from graphopt.passes.match import (FUSABLE_DTYPES, is_call, is_cast, is_scalar, is_tensor, only_user, other_operand,
                                   same_shape, value)
from graphopt.passes.rewrite import Miss, check_only_inside, replace

PATTERN = "rms_norm"
_FUNCTIONAL = (torch.nn.functional.rms_norm, torch.rms_norm)


_DYNAMIC_EPS = ("epsilon arrives as a runtime tensor: Dynamo made it dynamic because it changed between two "
                "compilations of the same code; call torch._dynamo.reset() between models, or set "
                "torch._dynamo.config.specialize_float = True")


def _constant(eps) -> float:
    """eps as a Python float. Under dynamic=True Dynamo passes float attributes as symbolic floats:
    those are specialized here with a guard, so a model whose eps changes recompiles. (Dynamo then
    restarts that first compilation once, with the floats constant.)"""
    if is_scalar(eps):
        return float(eps)
    if isinstance(eps, Node) and isinstance(value(eps), (torch.SymFloat, torch.SymInt)):
        return float(guard_float(value(eps)))
    if isinstance(eps, Node) and eps.op == "placeholder" and is_tensor(eps) and value(eps).dim() == 0:
        raise Miss(_DYNAMIC_EPS)
    raise Miss("epsilon is not a constant")


def _last_dim(dim, ndim) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and _last_dim(dim[0], ndim)
    return dim in (-1, ndim - 1)


def _match_core(rsqrt: Node):
    """rsqrt(mean(xf², -1, keepdim) + eps) and the xf * rsqrt it scales → (x, xf, eps, normed, nodes)."""
    add = rsqrt.args[0]
    if not is_call(add, torch.add) or len(add.args) != 2 or add.kwargs:
        raise Miss("rsqrt's argument is not `variance + eps`")
    variance, eps = add.args if is_call(add.args[0], torch.mean) else add.args[::-1]
    eps = _constant(eps)
    if not is_call(variance, torch.mean):
        raise Miss("the normalizer is not a mean (a sum or a norm is a different function)")
    square = variance.args[0]
    dim = variance.args[1] if len(variance.args) > 1 else variance.kwargs.get("dim")
    keepdim = variance.args[2] if len(variance.args) > 2 else variance.kwargs.get("keepdim", False)
    if not is_call(square, torch.pow) or square.args[1] != 2:
        raise Miss("the mean is not over squares")
    xf = square.args[0]
    if is_call(xf, torch.sub) and len(xf.args) == 2 and is_call(xf.args[1], torch.mean) and (
            xf.args[1].args[0] is xf.args[0]):
        raise Miss("a LayerNorm: the mean is subtracted before the squares (Cohere's norm), which an RMSNorm does "
                   "not do")
    if not _last_dim(dim, value(xf).dim()) or not keepdim:
        raise Miss(f"the mean is over dim={dim} (keepdim={keepdim}), not the last dimension with keepdim")
    if value(xf).dtype != torch.float32:
        raise Miss(f"the norm is computed in {value(xf).dtype}, not upcast to float32; "
                   "the fused op's fp32 math would change its numbers")
    normed = [u for u in rsqrt.users if is_call(u, torch.mul) and other_operand(u, rsqrt) is xf]
    if len(rsqrt.users) != 1 or len(normed) != 1:
        raise Miss("rsqrt does not scale the normalized input exactly once")
    normed = normed[0]
    x = xf.args[0] if is_cast(xf) else xf
    nodes = [square, variance, add, rsqrt, normed] + ([xf] if xf is not x else [])
    check_only_inside(nodes, normed, "norm")
    return x, eps, normed, nodes


def _weight_operand(other: Node, n_cols):
    """A [hidden] vector the normalized value is multiplied by → (weight, offset); Gemma's (1 + w) → offset 1."""
    offset = 0.0
    if is_call(other, torch.add) and len(other.args) == 2 and not other.kwargs:
        a, b = other.args
        tensor, const = (a, b) if isinstance(a, Node) else (b, a)
        if not is_scalar(const) or not is_tensor(tensor):
            return None
        other, offset = tensor, float(const)
    if is_cast(other) and value(other.args[0]).dtype in FUSABLE_DTYPES:
        other = other.args[0]
    v = value(other) if is_tensor(other) else None
    if v is None or v.dim() != 1 or not statically_known_true(v.shape[0] == n_cols):
        return None
    return other, offset


def _extend(normed: Node, n_cols, nodes):
    """Absorb what follows the normalization: casts and one multiply by a weight vector."""
    end, weight, offset = normed, None, 0.0
    while (user := only_user(end)) is not None:
        if is_cast(user):
            end = user
        elif weight is None and is_call(user, torch.mul) and isinstance(other_operand(user, end), Node):
            found = _weight_operand(other_operand(user, end), n_cols)
            if found is None:
                break
            (weight, offset), end = found, user
        else:
            break
        nodes.append(end)
    return end, weight, offset


def _match_rsqrt(rsqrt: Node):
    x, eps, normed, nodes = _match_core(rsqrt)
    end, weight, offset = _extend(normed, value(x).shape[-1], nodes)
    return x, weight, eps, offset, end, nodes


def _match_functional(node: Node):
    args = list(node.args) + [None] * 4
    x = args[0]
    shape = node.kwargs.get("normalized_shape", args[1])
    weight = node.kwargs.get("weight", args[2])
    eps = node.kwargs.get("eps", args[3])
    if len(shape) != 1:
        raise Miss(f"normalized_shape={list(shape)} spans more than the last dimension")
    eps = torch.finfo(value(x).dtype).eps if eps is None else _constant(eps)
    return x, weight, eps, 0.0, node, [node]


def _check_types(x: Node, weight, end: Node):
    for name, n in (("input", x), ("weight", weight), ("output", end)):
        if n is not None and value(n).dtype not in FUSABLE_DTYPES:
            raise Miss(f"{name} dtype {value(n).dtype} is not float32, bfloat16 or float16")
    if not same_shape(value(x), value(end)):
        raise Miss("the output shape differs from the input's (a broadcasting weight)")


def fuse_rmsnorm(gm: GraphModule, report) -> int:
    """Replace each matched RMSNorm with one graphopt::rms_norm node; record fusions and misses."""
    fused_modules, missed_modules, fused = set(), set(), 0
    anchors = [n for n in gm.graph.nodes if is_call(n, torch.rsqrt, *_FUNCTIONAL)]
    for anchor in anchors:
        try:
            match = _match_rsqrt if is_call(anchor, torch.rsqrt) else _match_functional
            x, weight, eps, offset, end, nodes = match(anchor)
            _check_types(x, weight, end)
        except Miss as miss:
            report.misses.append(record_for(anchor, PATTERN, str(miss)))
            missed_modules.add(module_path(anchor))
            continue
        op = replace(end, torch.ops.graphopt.rms_norm.default, (x, weight, eps, offset, value(end).dtype),
                     dead=nodes)
        report.fusions.append(record_for(op, PATTERN))
        fused_modules.add(module_path(op))
        fused += 1
    _record_unrecognised_modules(gm, report, fused_modules | missed_modules)
    gm.recompile()
    return fused


def _record_unrecognised_modules(gm, report, seen):
    """A module named like an RMSNorm that produced neither a fusion nor a miss: say so, once."""
    for node in gm.graph.nodes:
        path = module_path(node)
        if path in seen or "rmsnorm" not in module_class(node).lower():
            continue
        seen.add(path)
        last = [n for n in gm.graph.nodes if module_path(n) == path][-1]
        report.misses.append(record_for(last, PATTERN, f"module class {module_class(node)} computes its norm in a "
                                        "form the pass does not recognise (no rsqrt of a mean of squares)"))
