"""What every pass asks of an FX node: its traced value, what it calls, who uses it. No rewriting here."""

import re

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

# The dtypes graphopt's fused ops compute (fp32 math inside, one rounding to these).
FUSABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def value(node):
    """The traced value of a node (a FakeTensor for tensors), or the constant itself."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else node


def is_tensor(node) -> bool:
    return isinstance(value(node), torch.Tensor)


def is_cast(node) -> bool:
    return (isinstance(node, Node) and node.op == "call_method" and node.target == "to" and len(node.args) == 2
            and not node.kwargs and isinstance(node.args[1], torch.dtype))


def is_call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def only_user(node: Node):
    """The single user of node, or None when it has none or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def other_operand(node: Node, operand: Node):
    """For a binary call (torch.mul, torch.add, …) that uses `operand`, the other argument; None if node is not
    such a call."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    return b if a is operand else a if b is operand else None


def is_scalar(arg) -> bool:
    """A Python int or float constant (bool excluded)."""
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Shapes provably equal, symbolic sizes included, without adding a guard."""
    return len(a.shape) == len(b.shape) and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def autocast_regions(graph) -> dict:
    """Node → {device type: dtype, or None where autocast is off} for the torch.autocast regions the graph enters
    and exits itself (`with torch.autocast(...)` traced inside the model, e.g. accelerate's wrapped forward);
    autocast_dtype adds the state torch.compile was called under."""
    state, stack, regions = {}, [], {}
    for node in graph.nodes:
        if is_call(node, torch.amp.autocast_mode._enter_autocast):
            device, dtype, enabled = (list(node.args) + [None] * 3)[:3]
            stack.append(state)
            state = {**state, device: (dtype or torch.get_autocast_dtype(device)) if enabled else None}
        elif is_call(node, torch.amp.autocast_mode._exit_autocast) and stack:
            state = stack.pop()
        regions[node] = state
    return regions


def autocast_dtype(region: dict, device_type: str):
    """The autocast dtype for tensors of device_type in a region of autocast_regions (None: autocast off). Outside
    the graph's own regions, the state torch.compile was called under: Dynamo guards on it, so it holds whenever
    the graph runs."""
    if device_type in region:
        return region[device_type]
    enabled = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if enabled else None


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(sdpa: Node) -> dict:
    """A scaled_dot_product_attention call's arguments by name, positional ones included."""
    named = dict(zip(_SDPA_ARGS, sdpa.args))
    named.update(sdpa.kwargs)
    return named


def input_name(node: Node) -> str:
    """A graph input by the name the user passed it under: Dynamo calls `position_ids=` l_kwargs_position_ids_."""
    return re.sub(r"^l_(kwargs_)?|_$", "", node.name)
