"""Gated activations → graphopt::gated_activation: act(gate) * up.

Matches (after passes/normalize.py) the MLPs of Llama, Qwen2, Mistral (SwiGLU: F.silu), Gemma (GeGLU:
F.gelu(approximate="tanh")) and Phi-3 (gate and up halves of one fused gate_up_proj output, from chunk/split):
any torch.mul of one activation node and a tensor of the same shape and dtype. Every silu/gelu is a candidate;
one that does not match in full stays unfused with a miss record.
"""

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from graphopt.passes.describe import record_for
from graphopt.passes.match import FUSABLE_DTYPES, is_call, is_tensor, same_shape, value
from graphopt.passes.rewrite import Miss, replace

PATTERNS = {"silu": "swiglu", "gelu_tanh": "geglu"}


def _activation(node: Node) -> str:
    """"silu" or "gelu_tanh" for an activation node the op computes; Miss otherwise."""
    kwargs = dict(node.kwargs)
    if is_call(node, F.silu, torch.nn.functional.silu):
        if kwargs.get("inplace", node.args[1] if len(node.args) > 1 else False):
            raise Miss("in-place silu")
        return "silu"
    approximate = kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    if approximate != "tanh":
        raise Miss(f"gelu(approximate={approximate!r}): only the tanh approximation (GeGLU) is fused")
    return "gelu_tanh"


def _match(act: Node):
    activation = _activation(act)
    if len(act.users) != 1:
        raise Miss("the activation's output is also used outside the product")
    mul = next(iter(act.users))
    if not is_call(mul, torch.mul) or len(mul.args) != 2 or mul.kwargs or mul.args[0] is mul.args[1]:
        raise Miss("the activation is not multiplied by a gating tensor")
    up = mul.args[1] if mul.args[0] is act else mul.args[0]
    gate = act.args[0] if act.args else act.kwargs.get("input")
    if not (is_tensor(up) and is_tensor(gate)):
        raise Miss("the activation is multiplied by a constant, not an up projection")
    g, u = value(gate), value(up)
    if g.dtype != u.dtype or g.dtype not in FUSABLE_DTYPES or value(mul).dtype != g.dtype:
        raise Miss(f"gate {g.dtype} and up {u.dtype} are not one float32/bfloat16/float16 dtype")
    if not same_shape(g, u):
        raise Miss("gate and up shapes differ (a broadcasting product)")
    return gate, up, activation, mul


def fuse_swiglu(gm: GraphModule, report) -> int:
    """Replace each act(gate) * up with one graphopt::gated_activation node; record fusions and misses."""
    fused = 0
    candidates = [n for n in gm.graph.nodes if is_call(n, F.silu, F.gelu)]
    for act in candidates:
        try:
            gate, up, activation, mul = _match(act)
        except Miss as miss:
            report.misses.append(record_for(act, "swiglu" if is_call(act, F.silu) else "geglu", str(miss)))
            continue
        op = replace(mul, torch.ops.graphopt.gated_activation.default, (gate, up, activation), dead=[act])
        report.fusions.append(record_for(op, PATTERNS[activation]))
        fused += 1
    gm.recompile()
    return fused
