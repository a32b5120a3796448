"""PEFT LoRA Linear → graphopt::lora_linear.

Matches (after passes/normalize.py) what PEFT's lora.Linear.forward records:
  base = linear(x, W[, bias]);  xa = linear(x[.to(adapter dtype)], A);  out = base + linear(xa, B) * scaling
  [→ .to(result dtype)]
with identity dropout, one active adapter, a frozen plain-linear base. Every linear traced inside a `lora_B`
module is a candidate; one that does not match in full (dropout > 0, several active adapters, DoRA, a quantized
or trainable base, a lora_B bias) stays unfused with a miss record.
"""

import torch
from torch.fx import GraphModule, Node

from graphopt.passes.match import FUSABLE_DTYPES, is_call, is_cast, is_scalar, is_tensor, only_user, value
from graphopt.report import module_path, record_for

PATTERN = "lora"
_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_DROPOUT = (torch.nn.functional.dropout, torch.dropout)


class Miss(Exception):
    """The candidate is not a LoRA linear the fused op computes exactly; the message says why."""


def _linear_args(node: Node):
    args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
    return args[0], args[1], args[2]


def _is_lora_b(node: Node) -> bool:
    parts = module_path(node).split(".")
    return is_call(node, *_LINEAR) and len(parts) >= 2 and parts[-2] == "lora_B"


def _match(lora_b: Node):
    a_out, b_weight, b_bias = _linear_args(lora_b)
    if b_bias is not None:
        raise Miss("lora_B has a bias (lora_bias=True)")
    if not is_call(a_out, *_LINEAR) or len(a_out.users) != 1:
        raise Miss("lora_B's input is not the lora_A projection alone (DoRA or a variant)")
    x_adapter, a_weight, a_bias = _linear_args(a_out)
    if a_bias is not None:
        raise Miss("lora_A has a bias")
    if is_call(x_adapter, *_DROPOUT):
        raise Miss("LoRA dropout > 0: the fused op has no dropout; use lora_dropout=0.0")
    x = x_adapter.args[0] if is_cast(x_adapter) else x_adapter
    if x_adapter is not x and len(x_adapter.users) != 1:
        raise Miss("the adapter-dtype copy of the input is also used elsewhere")

    mul = only_user(lora_b)
    if not is_call(mul, torch.mul) or len(mul.args) != 2 or mul.args[0] is not lora_b:
        raise Miss("lora_B's output is not scaled once")
    scaling = mul.args[1]
    if not is_scalar(scaling):
        raise Miss("the LoRA scaling is not a constant")
    add = only_user(mul)
    if not is_call(add, torch.add) or len(add.args) != 2 or add.kwargs:
        raise Miss("the scaled LoRA output is not added to the base output")
    base = add.args[0] if add.args[1] is mul else add.args[1]
    if not is_call(base, *_LINEAR):
        raise Miss("the base output is not a plain linear (several active adapters, or a quantized or DoRA base)")
    base_x, weight, bias = _linear_args(base)
    if base_x is not x or len(base.users) != 1:
        raise Miss("the base linear and the adapters do not read the same input")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not is_tensor(t) or value(t).requires_grad):
            raise Miss(f"the base {name} trains (requires_grad); the fused op keeps it frozen")
    if value(x).dtype not in FUSABLE_DTYPES:
        raise Miss(f"input dtype {value(x).dtype} is not float32, bfloat16 or float16")

    end = add
    if (user := only_user(add)) is not None and is_cast(user):
        end = user
    return (x, weight, bias, a_weight, b_weight, float(scaling)), end, [end, add, mul, lora_b, a_out, base] + (
        [x_adapter] if x_adapter is not x else [])


def fuse_lora(gm: GraphModule, report) -> int:
    """Replace each matched LoRA linear with one graphopt::lora_linear node; record fusions and misses."""
    fused = 0
    for lora_b in [n for n in gm.graph.nodes if _is_lora_b(n)]:
        try:
            args, end, nodes = _match(lora_b)
        except Miss as miss:
            report.misses.append(record_for(lora_b, PATTERN, str(miss)))
            continue
        with gm.graph.inserting_before(end):
            op = gm.graph.call_function(torch.ops.graphopt.lora_linear.default, (*args, value(end).dtype))
        op.meta = dict(end.meta)
        end.replace_all_uses_with(op)
        for n in dict.fromkeys(nodes):  # in order, each once: users before what they use
            gm.graph.erase_node(n)
        report.fusions.append(record_for(op, PATTERN))
        fused += 1
    gm.recompile()
    return fused
