"""The cache policy (option cache_grad, default False): the KV cache a model returns is detached.

HF models called with use_cache (the default of most configs, in training too) return every layer's keys and
values, so they are graph outputs even when nobody reads them. An output that requires grad gets a gradient input
in the backward, and autograd materializes each unused one as zeros of its shape, alive through the whole backward:
2 × layers × [batch, kv heads, seq, head dim], 512 MiB at Llama-3-8B's shape with batch 2 × 2048 (measured on
the H200, benchmarks/RESULTS.md). Fine-tuning never differentiates through the returned cache, so each graph
output that an attention call also reads as its key or value (directly, or through the views and copies of
repeat_kv) is returned detached: the same values, no gradient input. cache_grad=True keeps them differentiable.
"""

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule

from graphopt.passes.match import is_call, sdpa_arguments

# What repeat_kv and the cache's update put between a cache tensor and the attention call that reads it
_PASS_THROUGH_METHODS = {"expand", "reshape", "view", "contiguous", "clone", "unsqueeze", "repeat_interleave"}
_PASS_THROUGH_FUNCTIONS = {torch.reshape, torch.repeat_interleave, torch.unsqueeze, operator.getitem}


def detach_cache(gm: GraphModule, report) -> int:
    """Replace each graph output that is an attention call's key or value by its detached view; return how many."""
    read_as_cache = set()
    for key, val in _keys_and_values(gm):
        stack = [key, val]
        while stack:
            node = stack.pop()
            if not isinstance(node, torch.fx.Node) or node in read_as_cache:
                continue
            read_as_cache.add(node)
            if _passes_through(node):
                stack.append(node.args[0])
    output = gm.graph.output_node()
    outputs, detached = list(output.args[0]), {}
    for i, node in enumerate(outputs):
        if node in read_as_cache:
            if node not in detached:
                with gm.graph.inserting_before(output):
                    detached[node] = gm.graph.call_method("detach", (node,))
            outputs[i] = detached[node]
    if detached:
        output.args = (tuple(outputs),) + tuple(output.args[1:])
        gm.recompile()
        report.notes.append(f"KV cache: {len(detached)} key/value outputs returned detached (cache_grad=False): "
                            "past_key_values carries no gradient, and the backward allocates none for it")
    return len(detached)


def _keys_and_values(gm):
    """(key, value) of each attention call: SDPA's, and graphopt::padded_attention's and packed_attention's
    (passes/attention.py)."""
    for node in gm.graph.nodes:
        if is_call(node, F.scaled_dot_product_attention):
            args = sdpa_arguments(node)
            yield args.get("key"), args.get("value")
        elif is_call(node, torch.ops.graphopt.padded_attention.default, torch.ops.graphopt.packed_attention.default):
            yield node.args[1], node.args[2]


def _passes_through(node) -> bool:
    return bool(node.args) and (
        (node.op == "call_method" and node.target in _PASS_THROUGH_METHODS)
        or (node.op == "call_function" and node.target in _PASS_THROUGH_FUNCTIONS))
