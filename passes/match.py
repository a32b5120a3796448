"""What every pass asks of an FX node: its traced value, what it calls, who uses it. No rewriting here."""

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


def is_scalar(arg) -> bool:
    """A Python int or float constant (bool excluded)."""
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Shapes provably equal, symbolic sizes included, without adding a guard."""
    return len(a.shape) == len(b.shape) and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


# Device types whose autocast state a graph may run under (torch.amp.is_autocast_available filters).
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def autocast_regions(graph) -> dict:
    """Node → {device type: dtype} of the torch.autocast regions it runs in: the state torch.compile was called
    under (Dynamo guards on it, so it holds whenever the graph runs), then the regions the graph enters and exits
    itself (`with torch.autocast(...)` traced inside the model, e.g. accelerate's wrapped forward)."""
    state = {d: torch.get_autocast_dtype(d) for d in AUTOCAST_DEVICES
             if torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d)}
    stack, regions = [], {}
    for node in graph.nodes:
        if is_call(node, torch.amp.autocast_mode._enter_autocast):
            device, dtype, enabled = (list(node.args) + [None] * 3)[:3]
            stack.append(state)
            state = dict(state)
            if enabled:
                state[device] = dtype or torch.get_autocast_dtype(device)
            else:
                state.pop(device, None)
        elif is_call(node, torch.amp.autocast_mode._exit_autocast) and stack:
            state = stack.pop()
        regions[node] = state
    return regions


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(sdpa: Node) -> dict:
    """A scaled_dot_product_attention call's arguments by name, positional ones included."""
    named = dict(zip(_SDPA_ARGS, sdpa.args))
    named.update(sdpa.kwargs)
    return named
