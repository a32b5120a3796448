"""What the passes and the report say about nodes and graphs: where a node came from (module path, class, source
line, type) and the report's record of it, and what a compiled backward saves and recomputes, per layer. Analysis
only; graphopt/report.py renders what the stages record."""

import hashlib
import re
from typing import Optional

import torch
from torch.utils.flop_counter import flop_registry

from graphopt.plan import Record


# --- where a node came from ------------------------------------------------------------------------------

_SITE = re.compile(r".*/(site|dist)-packages/")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def model_stack(node: torch.fx.Node) -> list:
    """The (path, class) of each module the node was traced in, outermost first, those of the compiled model only.
    A module reached through a global is not the model's: from transformers 5.25 the `kernels` package wraps
    functions such as apply_rotary_pos_emb in a module instance of its own, which Dynamo records as
    G['…'].apply_rotary_pos_emb inside the attention layer that calls it."""
    return [entry for entry in (node.meta.get("nn_module_stack") or {}).values() if not entry[0].startswith("G[")]


def module_path(node: torch.fx.Node) -> str:
    """The innermost module the node was traced in, as a dotted path from the compiled root."""
    stack = model_stack(node)
    if not stack:
        return "<top level>"
    path = stack[-1][0]
    # the compiled frame's root: L['self'], or L['args'][0] when a wrapper of forward was compiled (accelerate's
    # autocast around model.forward under nn.Module.compile)
    path = re.sub(r"^L\['[^']*'\](?:\[0\])?\.?", "", path)
    path = re.sub(r"\.?(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".") or "<root>"


def module_classes(node: torch.fx.Node) -> list:
    """Class names of the modules the node was traced in, outermost first."""
    return [cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
            for _, cls in model_stack(node)]


def module_class(node: torch.fx.Node) -> str:
    """The innermost module's class name ("" outside any module)."""
    classes = module_classes(node)
    return classes[-1] if classes else ""


def source_location(node: torch.fx.Node) -> str:
    """file:line of the user code that produced the node (the innermost frame Dynamo recorded)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return "<unknown>"
    file, line = frames[-1]
    return f"{_SITE.sub('', file)}:{line}"


def _call_name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def operation(node: torch.fx.Node) -> str:
    """A node as a person finds it in their code: what it calls and the source line (not the graph's names)."""
    return f"{_call_name(node)} at {source_location(node)}"


def node_key(node: torch.fx.Node) -> str:
    """A name for the node that every process capturing the same model gives it: `module path/call#k`, the k-th
    call of that operation traced in that module (graph names and Python ids are not stable)."""
    def scope(n):
        stack = model_stack(n)
        return stack[-1][0] if stack else None

    here, position = scope(node), 0
    for other in node.graph.find_nodes(op=node.op, target=node.target):  # in graph order, from FX's index
        if other is node:
            break
        position += scope(other) == here
    return f"{module_path(node)}/{_call_name(node)}#{position}"


def tensor_type(node: torch.fx.Node):
    """(dtype name, shape as a list of ints or symbol names) from the node's traced value."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor):
        return "?", []
    shape = [int(s) if isinstance(s, int) else str(s) for s in value.shape]
    return str(value.dtype).replace("torch.", ""), shape


def graph_inputs(gm: torch.fx.GraphModule, example_inputs) -> tuple:
    """(a hash of the graph's inputs: their names, dtypes and shapes; a hash of the parameters among them alone):
    what a saved plan is found by for a graph (graphopt/plan_dir.py). Dynamo names each input after where the
    model reads it (l_self_modules_…_parameters_weight_), so the same model gives the same names in any process."""
    everything, parameters = hashlib.sha256(), hashlib.sha256()
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        line = f"{node.name}:{type(value).__name__}:" + (f"{value.dtype}:{[str(s) for s in value.shape]}"
                                                          if isinstance(value, torch.Tensor) else "")
        everything.update(line.encode() + b"\n")
        if isinstance(value, torch.nn.Parameter):
            parameters.update(line.encode() + b"\n")
    return everything.hexdigest()[:16], parameters.hexdigest()[:16]


def record_for(node: torch.fx.Node, pattern: str, reason: Optional[str] = None) -> Record:
    dtype, shape = tensor_type(node)
    return Record(pattern, module_path(node), source_location(node), dtype, shape, reason, node_key(node))


def saved_for_backward(backward: torch.fx.GraphModule, largest: int = 5) -> dict:
    """What a compiled backward graph reads that the forward saved: its tensor inputs except the incoming
    gradients (aot_autograd names those tangents_*), split into activations (made by the forward: the memory
    that saving costs) and the forward's own inputs it keeps (primals_*: weights, ids — alive anyway); and what
    it recomputes of the forward instead (the partitioner tags those nodes is_forward): bytes written and FLOPs.
    Per layer (the module path up to its index in a ModuleList, e.g. model.layers.3): the same. Sizes are ints,
    or sympy text under dynamic shapes."""
    tensors = [node for node in backward.graph.nodes if node.op == "placeholder"
               and not node.name.startswith("tangents") and isinstance(node.meta.get("val"), torch.Tensor)]
    saved_nodes = [node for node in tensors if not node.name.startswith("primals")]
    saved = [node.meta["val"] for node in saved_nodes]
    inputs = [node.meta["val"] for node in tensors if node.name.startswith("primals")]
    per_layer = {}

    def add(node, key, amount):
        entry = per_layer.setdefault(layer_of(node), {"saved_bytes": 0, "recomputed_bytes": 0, "recomputed_flops": 0})
        entry[key] = entry[key] + amount

    recomputed = [node for node in backward.graph.nodes
                  if node.op == "call_function" and node.meta.get("partitioner_tag") == "is_forward"]
    recomputed_bytes = recomputed_flops = 0
    for node in recomputed:
        written, flops = bytes_written(node), _flops(node)
        recomputed_bytes, recomputed_flops = recomputed_bytes + written, recomputed_flops + flops
        add(node, "recomputed_bytes", written)
        add(node, "recomputed_flops", flops)
    total, groups = 0, {}
    for node, t in zip(saved_nodes, saved):
        size = t.numel() * t.element_size()
        add(node, "saved_bytes", size)
        total = total + size
        key = (str(t.dtype).replace("torch.", ""), tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape))
        count, group_bytes = groups.get(key, (0, 0))
        groups[key] = (count + 1, group_bytes + size)
    ranked = sorted(groups.items(), key=lambda kv: size_hint(kv[1][1]), reverse=True)[:largest]
    inputs_bytes = sum(t.numel() * t.element_size() for t in inputs)
    return {"tensors": len(saved), "bytes": plain(total), "inputs_kept": len(inputs),
            "inputs_kept_bytes": plain(inputs_bytes),
            "largest": [{"dtype": d, "shape": list(s), "count": c, "bytes": plain(b)} for (d, s), (c, b) in ranked],
            "recomputed": {"ops": len(recomputed), "bytes": plain(recomputed_bytes),
                           "flops": plain(recomputed_flops)},
            "per_layer": {layer: {k: plain(v) for k, v in per_layer[layer].items()}
                          for layer in sorted(per_layer, key=_natural)}}


_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def _natural(path: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def is_layer(path: str) -> bool:
    """Whether a layer_of() path is one element of a ModuleList (a decoder layer)."""
    return _LAYER.match(path) is not None


def layer_of(node: torch.fx.Node) -> str:
    """The module path up to the first index into a ModuleList (one decoder layer), else the whole path."""
    path = module_path(node)
    match = _LAYER.match(path)
    return match.group(1) if match else path


def bytes_written(node: torch.fx.Node):
    """Bytes of the tensors a node creates (views create none)."""
    if getattr(node.target, "is_view", False):
        return 0
    values = node.meta.get("val")
    values = values if isinstance(values, (tuple, list)) else [values]
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


def _flops(node: torch.fx.Node):
    """FLOPs of a node from torch's FLOP formulas (matmuls, attention, and graphopt's in passes/recompute.py);
    0 for the rest (pointwise, reductions: memory-bound)."""
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0
    args, kwargs = torch.utils._pytree.tree_map(
        lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a, (node.args, node.kwargs))
    return formula(*args, out_val=node.meta.get("val"), **kwargs)


def plain(n):
    return n if isinstance(n, int) else str(n)  # a SymInt as its expression, never specialized


def size_hint(n):
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)  # symbolic: order by its hint, adding no guard
    return hint if hint is not None else 0
