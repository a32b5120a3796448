"""Partition: what the backward saves, recomputes or offloads, under `memory_budget` (0..1 or "auto").

The decision is torch's: aot_autograd's min-cut partitioner, and under a budget below 1 its 0-1 knapsack
(`torch._functorch.config.activation_memory_budget`), which picks the cheapest values to recompute until the saved
activations fit between the least it can save (budget 0) and what the fastest plan saves (budget 1). Partitioner
below is the partition function graphopt hands to aot_autograd: it runs torch's under the chosen budget, then
plans the offload (passes/offload.py) and estimates the step's peak (passes/memory.py). What torch lacks and
this module adds:

- layer boundaries. Below budget 1 the tensors entering and leaving every decoder layer are saved
  (save_layer_boundaries), so 0 means per-layer checkpointing: each layer's backward recomputes that layer's
  forward only, and what is saved is the residual stream between layers, which offload=True then moves to host
  memory. The fused loss is never recomputed (never_recompute_the_loss), nor any random draw
  (never_recompute_random_draws), nor a LoRA linear's x·Aᵀ (never_recompute_lora_down).
- memory_budget="auto": the fastest plan whose estimated peak fits max_memory_gib, or without it a multiple of
  the weights the graph reads (Partitioner._choose, WEIGHTS_MULTIPLE).
- graphopt ops as candidates with a cost. torch bans recomputing any op it does not know; here every graphopt op
  is a candidate, priced by the FLOP formulas below (the knapsack's "flops" estimator): the fused LoRA linear and
  the fused loss cost their matmuls, so they are recomputed last; RMSNorm, RoPE and the gated activation have no
  matmul and cost nothing, like the pointwise aten ops around them.
- cheap results read by a backward matmul may be recomputed. torch never recomputes a value that a non-fusible op
  reads in the backward (`ban_recompute_materialized_backward`); with graphopt ops that ban keeps the gated
  product (read by the down projection's LoRA backward), the normed hidden states and repeat_kv's copies of k and
  v alive for nothing: they are recomputed from what their own backward keeps anyway. At the 1B shape on the
  H200 that took the fastest plan from 15.5 to 11.4 GiB, with no loss of speed (benchmarks/RESULTS.md).
"""

import hashlib
import json
import math

import torch
import torch._functorch.config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry, register_flop_formula

from graphopt.fingerprint import code_fingerprint
from graphopt.passes import offload as offload_pass
from graphopt.passes.describe import is_layer, layer_of, saved_for_backward, size_hint
from graphopt.passes.graph_pool import copy_out_of_graph_pool
from graphopt.passes.memory import estimate_peak

GIB = 2**30
# What the graphs do not show and "auto" must leave room for: the fused ops' own temporaries (the loss's logits
# chunk, the LoRA kernels' partial sums), cuBLAS workspaces, the optimizer's state, the allocator's rounding.
# Measured peak minus estimate on the H200: 0.56–1.15 GiB at the 1B and 8B shapes (benchmarks/RESULTS.md).
UNSEEN_RESERVE_GIB = 1.25
# memory_budget="auto" without max_memory_gib: the estimated peak may hold this many times the bytes of the
# parameters the graph reads. A fixed budget cannot serve every size: at the Llama-3.2-1B shape the activations
# dominate the peak, and 2× Unsloth's memory (7.30 GiB) is budget ≈0.6 (estimate 6,722 MiB, 2.80× the 2,400 MiB of
# weights and adapters); at Llama-3-8B's the weights do, and budget 1 (estimate 27,528 MiB, 1.78× its 15,476 MiB)
# is 1.19× faster than 0.6 at 1.24× the memory (H200, benchmarks/RESULTS.md, 2026-12-01: CUDA graphs by
# default). 2.75× takes budget 1 where the saved activations are at most about the weights' size, and keeps ~0.5
# GiB under 2× Unsloth at 1B for what the estimate does not show (measured − estimated there: +0.5 GiB under CUDA graphs).
WEIGHTS_MULTIPLE = 2.75
AUTO_STEPS = 4  # bisection steps of memory_budget="auto" between 0 and 1: a budget within 1/16 of the best


def weights_bytes(example_inputs) -> int:
    """The bytes of the parameters among a graph's inputs that "auto" sizes the plan to, a bitsandbytes 4-bit
    weight (Params4bit, its quant_state the dense shape and dtype) counted at its dequantized size: the activations
    weighed against the weights scale with the layers' sizes, not with how the weights are stored, and at a quarter
    of the bytes "auto" would pick a far leaner, slower plan for a QLoRA model than for the same model in bf16."""
    total = 0
    for x in example_inputs:
        if isinstance(x, torch.nn.Parameter):
            dense = getattr(x, "quant_state", None)
            total += math.prod(dense.shape) * dense.dtype.itemsize if dense is not None else x.nbytes
    return total


class Partitioner(CustomPartitionerFn):
    """aot_autograd's partition function for one compile (Inductor's custom_partitioner_fn, or aot_autograd's
    partition_fn without Inductor): torch's min-cut partitioner under the chosen budget, then the offload plan.
    The decision becomes the plan's saved_for_backward (graphopt/plan.py)."""

    def __init__(self, memory_budget, offload: bool, max_memory_gib, offload_copies: bool, plan,
                 leaf_inputs=None, weights_bytes=0, requested=None):
        self.memory_budget, self.offload, self.max_memory_gib = memory_budget, offload, max_memory_gib
        # The settings asked for, which decide the partition of a given graph: memory_budget, offload and
        # max_memory_gib as the options gave them. A plan directory's graph runs with the saved decision instead
        # (memory_budget fixed, no search) but asks as the compile that made it did, and so keys the same.
        self.requested = requested or {"memory_budget": memory_budget, "offload": offload,
                                       "max_memory_gib": max_memory_gib}
        self.weights_bytes = weights_bytes  # of the parameters among the graph's inputs: "auto" without a limit
        self.offload_copies = offload_copies  # the target's lowering moves the data (else: the plan is reported)
        self.plan = plan
        # Under CUDA graphs: one bool per input of the compiled graph, True for a leaf that requires grad, whose
        # gradient becomes its .grad (passes/graph_pool.py); None without CUDA graphs
        self.leaf_inputs = leaf_inputs

    def __call__(self, joint, joint_inputs, **kwargs):
        if self.memory_budget == "auto":
            chosen, tried = self._choose(joint, joint_inputs, kwargs)
        else:
            chosen, tried = self._plan(joint, joint_inputs, kwargs, self.memory_budget, self.offload), []
        budget, offload, (forward, backward), plan, estimate = chosen
        decision = {"memory_budget": budget, "requested": self.requested["memory_budget"],
                    **saved_for_backward(backward), "estimate": estimate.to_json(),
                    "offload": None}
        if plan is not None:
            decision["offload"] = plan.to_json(layers=decision["per_layer"])
            if plan.moves_data:
                offload_pass.insert_transfers(forward, backward, plan)
        if self.leaf_inputs is not None:
            primals = len(joint_inputs[0])
            # aot_autograd dedupes repeated inputs: then the primals are not the inputs one for one, copy them all
            leaves = ([i for i, leaf in enumerate(self.leaf_inputs) if leaf] if len(self.leaf_inputs) == primals
                      else None)
            copy_out_of_graph_pool(forward, backward, kwargs["num_fwd_outputs"], primals, leaves)
            if plan is not None and plan.moves_data:
                decision["offload"]["prefetches_dropped"] = offload_pass.prefetch_within_partitions(backward)
        if self.memory_budget == "auto":
            by_weights, limit = self.max_memory_gib is None, self._limit()
            decision["auto"] = {"max_memory_gib": self.max_memory_gib,
                                "reserve_gib": None if by_weights else UNSEEN_RESERVE_GIB,
                                "weights_bytes": self.weights_bytes if by_weights else None,
                                "weights_multiple": WEIGHTS_MULTIPLE if by_weights else None,
                                "limit_bytes": None if limit == math.inf else int(limit),
                                "offload": offload,
                                "fits": size_hint(estimate.peak) <= limit,
                                "tried": [{"memory_budget": b, "offload": o, "estimated_peak_bytes": e}
                                          for b, o, e in tried]}
        self.plan.saved_for_backward = decision
        return forward, backward

    def _plan(self, joint, joint_inputs, kwargs, budget, offload):
        """(budget, offload, (forward, backward), offload plan or None, memory estimate) for one setting, made
        on a copy of the joint graph (the partitioner edits the graph it is given)."""
        graphs = _partition(joint, joint_inputs, kwargs, budget)
        plan = (offload_pass.plan_offload(*graphs, kwargs["num_fwd_outputs"], self.offload_copies)
                if offload else None)
        estimate = estimate_peak(*graphs, offloaded=offload_pass.held_until(graphs[0], plan) if plan else {})
        return budget, offload, graphs, plan, estimate

    def _limit(self):
        """The bytes an "auto" plan's estimated peak must fit: max_memory_gib less the reserve for what the graphs
        do not show (UNSEEN_RESERVE_GIB), or without max_memory_gib WEIGHTS_MULTIPLE × the parameters' bytes. A
        graph that reads no parameters (a compiled function, not a model) has nothing to size the plan to: no
        limit, so the fastest plan."""
        if self.max_memory_gib is None:
            return WEIGHTS_MULTIPLE * self.weights_bytes if self.weights_bytes else math.inf
        return (self.max_memory_gib - UNSEEN_RESERVE_GIB) * GIB

    def _choose(self, joint, joint_inputs, kwargs):
        """memory_budget="auto": the fastest plan whose estimated peak fits the limit (_limit). The fastest is
        budget 1; then the largest budget that fits (bisection); then, under max_memory_gib, budget 0 with offload.
        Nothing fits: the leanest plan there is (budget 0 on the device where offload is not taken: it is taken
        only when asked for by a limit), and the report says by how much it misses."""
        limit, tried = self._limit(), []

        def attempt(budget, offload=False):
            plan = self._plan(joint, joint_inputs, kwargs, budget, offload)
            tried.append((budget, offload, size_hint(plan[-1].peak)))
            return plan, size_hint(plan[-1].peak) <= limit

        best, fits = attempt(1.0)
        if fits:
            return best, tried
        lowest, fits = attempt(0.0)
        if not fits:
            return (attempt(0.0, offload=True)[0] if self.max_memory_gib is not None else lowest), tried
        best, low, high = lowest, 0.0, 1.0
        for _ in range(AUTO_STEPS):
            middle = (low + high) / 2
            plan, fits = attempt(middle)
            if fits:
                best, low = plan, middle
            else:
                high = middle
        return best, tried

    def uuid(self):
        """The partitioner's part of the keys Inductor's and AOTAutograd's caches file a graph under: graphopt's
        code (graphopt/fingerprint.py) and what decides the partition besides the graph (the settings asked for,
        whether the lowering moves offloaded data, whether the gradients leave a CUDA graphs' pool). The same graph
        asked the same way is partitioned the same way: AOTAutograd's cache, which holds the partitioned graphs,
        may then serve it without running the partitioner (graphopt/plan_dir.py)."""
        return hashlib.sha256(json.dumps(self.__getstate__(), sort_keys=True).encode()).hexdigest()

    def __getstate__(self):  # Inductor pickles its config into the caches' keys: this stands for the partitioner
        return {"code": code_fingerprint(), "requested": self.requested, "offload_copies": self.offload_copies,
                "leaf_inputs": self.leaf_inputs, "weights_bytes": self.weights_bytes}

    def __deepcopy__(self, memo):  # Inductor copies its config for the backward's compile: this compile's partitioner
        return self


def _partition(joint, joint_inputs, kwargs, budget):
    """torch's min-cut partition of a copy of the joint graph (it edits the graph it is given) under budget, with
    graphopt's rules."""
    joint = _copy(joint)
    if budget < 1:
        save_layer_boundaries(_forward_nodes(joint, kwargs["num_fwd_outputs"]))
        never_recompute_the_loss(joint)
        never_recompute_lora_down(joint)
    never_recompute_random_draws(joint)
    with torch._functorch.config.patch(partitioner_config(budget)):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _forward_nodes(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> set:
    """The joint graph's forward: what the model's outputs are computed from."""
    forward, stack = set(), list(joint.graph.find_nodes(op="output")[0].args[0][:num_fwd_outputs])
    while stack:
        node = stack.pop()
        if isinstance(node, torch.fx.Node) and node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    return forward


def save_layer_boundaries(forward: set) -> None:
    """Below budget 1, every tensor that crosses a decoder layer's boundary in the forward is saved: what a layer
    reads from outside it (the residual stream, the rotary tables, the mask) and what it hands out (the last
    layer's output, read by the final norm). The backward then recomputes within one layer at a time. Without
    this, budget 0 saves nothing and recomputes the whole forward before the last layer's backward, holding all
    of it at once. forward: the joint graph's forward nodes (_forward_nodes)."""
    for node in forward:
        for arg in node.all_input_nodes:
            crosses = layer_of(arg) != layer_of(node) and (is_layer(layer_of(node)) or is_layer(layer_of(arg)))
            if arg.op == "call_function" and crosses:
                arg.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def never_recompute_lora_down(joint: torch.fx.GraphModule) -> None:
    """A LoRA linear's x·Aᵀ (graphopt::lora_down), which its backward reads, is saved, never recomputed: it is
    [tokens, rank] (in fp32 at rank 16, 1/128 of the bytes of a bf16 x of 4,096 features), while recomputing it
    reads all of x again, a cost the knapsack's FLOP estimate does not see. A linear the backward recomputes for
    its output then redoes only the base matmul and ·Bᵀ; one whose output the backward does not read (the down
    projection, whose output meets the residual stream at the layer's saved boundary) is not recomputed at all."""
    for node in joint.graph.find_nodes(op="call_function", target=torch.ops.graphopt.lora_down.default):
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def never_recompute_the_loss(joint: torch.fx.GraphModule) -> None:
    """The fused loss computes its gradients in the forward. As a knapsack candidate it looks cheap to recompute
    (one [tokens, hidden] output for its FLOPs), but the backward needs it first, right after the forward, so
    recomputing it saves nothing at the peak and repeats the lm_head's matmuls (a third of the 1B step's FLOPs)."""
    for node in joint.graph.find_nodes(op="call_function", target=torch.ops.graphopt.linear_cross_entropy.default):
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # banned from recompute; its getitems get saved


# The aten ops a random draw reaches the joint graph as (fused LoRA dropout: bernoulli; torch's own: the rest).
# Not every op tagged nondeterministic_seeded: SDPA carries the tag for its dropout, and saving it would change
# the plan of every attention layer.
_RANDOM_DRAWS = {torch.ops.aten.bernoulli, torch.ops.aten.bernoulli_, torch.ops.aten.rand, torch.ops.aten.rand_like,
                 torch.ops.aten.randn, torch.ops.aten.randn_like, torch.ops.aten.native_dropout,
                 torch.ops.aten.uniform, torch.ops.aten.normal}


def never_recompute_random_draws(joint: torch.fx.GraphModule) -> None:
    """A random draw recomputed in the backward would draw again: a fused LoRA dropout's mask (passes/fuse_lora.py)
    would differ from the forward's, and the gradients be silently wrong. The partitioner's own list may not hold
    every such op (bernoulli is not in it), so each is marked must-save here."""
    for node in joint.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _RANDOM_DRAWS:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _copy(joint):
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(joint.graph, {}))
    return torch.fx.GraphModule(joint, graph)


def partitioner_config(memory_budget: float) -> dict:
    """torch._functorch.config settings for one partition under memory_budget."""
    config = {"ban_recompute_materialized_backward": False}
    if memory_budget < 1:  # the knapsack runs only below 1
        config.update({
            # torch's budget 0 returns "save the graph's inputs" before looking at what must be saved (the
            # layer inputs above): a budget just above 0 gets the knapsack, which honours it
            "activation_memory_budget": max(float(memory_budget), 1e-6),
            "activation_memory_budget_runtime_estimator": "flops",
            # graphopt ops become knapsack candidates, priced by their FLOP formulas, instead of never
            # recomputed (the setting exists since torch 2.10)
            "is_non_builtin_to_include": True,
        })
    return config


def _rows(shape):
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows


@register_flop_formula(torch.ops.graphopt.lora_down)
def _lora_down_flops(x_shape, lora_a_shape, *args, **kwargs):
    return 2 * _rows(x_shape) * lora_a_shape[0] * lora_a_shape[1]


@register_flop_formula(torch.ops.graphopt.lora_linear)
def _lora_linear_flops(x_shape, weight_shape, bias_shape, lora_a_shape, *args, **kwargs):
    rows, (out_features, in_features), rank = _rows(x_shape), weight_shape, lora_a_shape[0]
    return 2 * rows * out_features * in_features + 2 * rows * rank * out_features


@register_flop_formula(torch.ops.graphopt.lora_linear_4bit)
def _lora_linear_4bit_flops(x_shape, packed_shape, shape, absmax_shape, blocksize, quant_type, bias_shape,
                            absmax_8bit_shape, absmax_code_shape, absmax_offset_shape, lora_a_shape, *args, **kwargs):
    rows, (out_features, in_features), rank = _rows(x_shape), shape, lora_a_shape[0]
    return 2 * rows * out_features * in_features + 2 * rows * rank * out_features


@register_flop_formula(torch.ops.graphopt.linear_cross_entropy)
def _linear_cross_entropy_flops(hidden_shape, weight_shape, bias_shape, target_shape, ignore_index, reduction,
                                softcap, chunk_rows, grad_hidden, grad_weight, **kwargs):
    rows, (vocab, hidden) = hidden_shape[0], weight_shape
    return 2 * rows * vocab * hidden * (1 + grad_hidden + grad_weight)  # logits, then each gradient asked for


# TRL's head (graphopt::linear_logprobs) is priced by its lm_head matmul, so the knapsack keeps its [tokens] outputs
# (log_z, entropy) rather than recompute it. It computes no gradient in the forward (the backward recomputes the
# logits), so a recompute would cost time, never correctness: never_recompute_the_loss leaves it to the knapsack.
@register_flop_formula(torch.ops.graphopt.linear_logprobs)
def _linear_logprobs_flops(hidden_shape, weight_shape, *args, **kwargs):
    rows, (vocab, hidden) = hidden_shape[0], weight_shape
    return 2 * rows * vocab * hidden


@register_flop_formula(torch.ops.graphopt.linear_logprobs_backward)
def _linear_logprobs_backward_flops(grad_log_probs_shape, grad_entropy_shape, hidden_shape, weight_shape, bias_shape,
                                    targets_shape, log_z_shape, entropy_shape, temperature, softcap, logit_scale,
                                    compute_dtype, chunk_rows, grad_hidden, grad_weight, **kwargs):
    rows, (vocab, hidden) = hidden_shape[0], weight_shape
    return 2 * rows * vocab * hidden * (1 + grad_hidden + grad_weight)  # the logits again, then each gradient


# Attention over a padded or packed batch: QKᵀ and PV over the pairs a query attends, causal (about half the row),
# within the sliding window where there is one, counted over the whole row (an upper bound: the kernels skip the
# padding and the other documents, which the shapes do not show).
@register_flop_formula([torch.ops.graphopt.padded_attention, torch.ops.graphopt.packed_attention])
def _masked_attention_flops(q_shape, k_shape=None, v_shape=None, tokens_shape=None, scale=None, window=None, **kwargs):
    batch, heads, length, dim = q_shape
    reach = length if window is None else min(window, length)
    pairs = length * reach - reach * reach // 2
    return 4 * batch * heads * pairs * dim


@register_flop_formula([torch.ops.graphopt.padded_attention_backward, torch.ops.graphopt.packed_attention_backward])
def _masked_attention_backward_flops(grad_out_shape, q_shape, k_shape, v_shape, tokens_shape, out_shape, lse_shape,
                                     scale, window=None, **kwargs):
    # dV, dP, dQ, dK and the recomputed scores: 2.5× the forward
    return 5 * _masked_attention_flops(q_shape, window=window) // 2


# torch before 2.13 counts SDPA's FLOPs only when k and v have q's number of heads: under GQA (enable_gqa, which
# passes/attention.py sets) its formula raises, in the knapsack's estimator and in the report. Counted here as the
# repeated k and v SDPA computes with, which is what later torch counts too.
def _gqa_counted_as_repeated(formula, query_at):
    def count(*args, **kwargs):
        query, key, value = args[query_at:query_at + 3]
        if key.shape[1] != query.shape[1]:
            key, value = (t.new_empty((t.shape[0], query.shape[1], *t.shape[2:])) for t in (key, value))
            args = (*args[:query_at], query, key, value, *args[query_at + 3:])
        return formula(*args, **kwargs)
    return count


_aten = torch.ops.aten
for _op, _query_at in [(_aten._scaled_dot_product_cudnn_attention, 0), (_aten._scaled_dot_product_flash_attention, 0),
                       (_aten._scaled_dot_product_efficient_attention, 0),
                       (_aten._scaled_dot_product_cudnn_attention_backward, 1),
                       (_aten._scaled_dot_product_flash_attention_backward, 1),
                       (_aten._scaled_dot_product_efficient_attention_backward, 1)]:
    flop_registry[_op] = _gqa_counted_as_repeated(flop_registry[_op], _query_at)
