"""One spelling per op, so that fusion patterns match whatever spelling the model's source used.

Rewrites (Dynamo's torch-level graph, before autograd):
  x.float() / .half() / .bfloat16() / .double() / .type(d) / .type_as(y) / .to(dtype=d)  →  x.to(d)
  casts to the dtype x already has                                                      →  dropped
  x.__eq__(y) and the other operator methods (Dynamo records some comparisons so)       →  operator.eq(x, y)
  x.op(...) for arithmetic and reductions, and operator.* on tensors                    →  torch.op(x, ...)
  x ** 2, x.square(), x * x, pow(x, 2.0)                                                →  torch.pow(x, 2)
  pow(v, -0.5), 1 / sqrt(v), reciprocal(sqrt(v))                                        →  torch.rsqrt(v)
  x / sqrt(v)                                                                           →  x * rsqrt(v)
Each rewrite keeps the replaced node's metadata (traced value, module stack, source), which the report needs.
"""

import operator

import torch
from torch.fx import GraphModule, Node

from graphopt.passes.match import is_call, is_cast, is_tensor, value

_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_FUNCTION_METHODS = ("add", "sub", "mul", "div", "pow", "mean", "sum", "rsqrt", "sqrt", "square", "reciprocal", "neg")
_OPERATOR_METHODS = {f"__{name.rstrip('_')}__": getattr(operator, name) for name in (
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "add", "sub", "mul", "truediv", "getitem")}
_OPERATORS = {operator.add: torch.add, operator.sub: torch.sub, operator.mul: torch.mul,
              operator.truediv: torch.div, operator.pow: torch.pow, operator.neg: torch.neg}


def _replace(node: Node, op: str, target, args, kwargs=None) -> Node:
    with node.graph.inserting_before(node):
        new = node.graph.create_node(op, target, tuple(args), dict(kwargs or {}))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
    return new


def _cast_dtype(node: Node):
    """The dtype a cast-like call_method converts to, or None if the node is not a pure dtype cast."""
    if node.op != "call_method" or not is_tensor(node.args[0]):
        return None
    args, kwargs = node.args[1:], dict(node.kwargs)
    if node.target in _CAST_METHODS and not args and not kwargs:
        return _CAST_METHODS[node.target]
    if node.target == "type_as" and len(args) == 1 and not kwargs and is_tensor(args[0]):
        return value(args[0]).dtype
    if node.target == "type" and len(args) == 1 and isinstance(args[0], torch.dtype) and not kwargs:
        return args[0]
    if node.target == "to":
        device = kwargs.pop("device", None)
        if device is not None and torch.device(device) != value(node.args[0]).device:
            return None
        if len(args) == 1 and isinstance(args[0], torch.dtype) and not kwargs:
            return args[0]
        if not args and set(kwargs) == {"dtype"} and isinstance(kwargs["dtype"], torch.dtype):
            return kwargs["dtype"]
        if not args and not kwargs and device is not None:
            return value(node.args[0]).dtype  # .to(same device): a no-op
    return None


def _rewrite(node: Node):
    """Apply the first rule that fits; return the new node, or None if no rule applies."""
    if node.op == "call_method":
        dtype = _cast_dtype(node)
        if dtype is not None and not is_cast(node):
            return _replace(node, "call_method", "to", (node.args[0], dtype))
        if node.target in _OPERATOR_METHODS and is_tensor(node.args[0]) and len(node.args) == 2 and not node.kwargs:
            return _replace(node, "call_function", _OPERATOR_METHODS[node.target], node.args)
        if node.target in _FUNCTION_METHODS and is_tensor(node.args[0]):
            return _replace(node, "call_function", getattr(torch, node.target), node.args, node.kwargs)
        return None
    if node.op != "call_function":
        return None

    args = node.args
    if node.target in _OPERATORS and any(is_tensor(a) for a in args):
        target = _OPERATORS[node.target]
        if target in (torch.add, torch.mul) and not is_tensor(args[0]):
            return _replace(node, "call_function", target, (args[1], args[0]))
        if target is torch.sub and not is_tensor(args[0]):
            return _replace(node, "call_function", torch.rsub, (args[1], args[0]))
        if target is torch.div and not is_tensor(args[0]):
            if args[0] == 1 and is_call(args[1], torch.sqrt):
                return _replace(node, "call_function", torch.rsqrt, args[1].args)
            return None  # scalar / tensor: no torch.div spelling; leave it
        return _replace(node, "call_function", target, args, node.kwargs)

    if is_call(node, torch.square):
        return _replace(node, "call_function", torch.pow, (args[0], 2))
    if is_call(node, torch.mul) and len(args) == 2 and args[0] is args[1] and not node.kwargs:
        return _replace(node, "call_function", torch.pow, (args[0], 2))
    if is_call(node, torch.pow) and len(args) == 2 and not node.kwargs and isinstance(args[1], float):
        if args[1] == 2.0:
            return _replace(node, "call_function", torch.pow, (args[0], 2))
        if args[1] == -0.5:
            return _replace(node, "call_function", torch.rsqrt, (args[0],))
    if is_call(node, torch.reciprocal) and is_call(args[0], torch.sqrt):
        return _replace(node, "call_function", torch.rsqrt, args[0].args)
    if (is_call(node, torch.div) and len(args) == 2 and not node.kwargs and is_call(args[1], torch.sqrt)
            and len(args[1].users) == 1):
        sqrt = args[1]
        with node.graph.inserting_before(node):
            rsqrt = node.graph.call_function(torch.rsqrt, sqrt.args)
        rsqrt.meta = dict(sqrt.meta)
        return _replace(node, "call_function", torch.mul, (args[0], rsqrt))
    return None


def _drop_noop_cast(node: Node) -> bool:
    if is_cast(node) and is_tensor(node.args[0]) and value(node.args[0]).dtype == node.args[1]:
        node.replace_all_uses_with(node.args[0])
        node.graph.erase_node(node)
        return True
    return False


def normalize(gm: GraphModule) -> int:
    """Rewrite gm in place to the canonical spellings; returns the number of rewrites."""
    rewrites = 0
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if _drop_noop_cast(node) or _rewrite(node) is not None:
                rewrites += 1
                changed = True
    # Rewrites only ever orphan the pure nodes they bypassed (a sqrt replaced by rsqrt).
    for node in reversed(list(gm.graph.nodes)):
        if is_call(node, torch.sqrt) and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return rewrites
