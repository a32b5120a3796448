"""What the backward saves and what it recomputes, under `memory_budget` (0..1).

The decision is torch's: aot_autograd's min-cut partitioner, and under a budget below 1 its 0-1 knapsack
(`torch._functorch.config.activation_memory_budget`), which picks the cheapest values to recompute until the saved
activations fit budget × (what the fastest plan saves). 1 is the fastest plan; 0 keeps only the graph's inputs
and recomputes the whole forward. What torch lacks and this module adds:

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

import torch
import torch._functorch.config
from torch.utils.flop_counter import register_flop_formula


def partitioner_config(memory_budget: float) -> dict:
    """torch._functorch.config settings for one compile: torch._functorch.config.patch(partitioner_config(b))."""
    config = {"ban_recompute_materialized_backward": False}
    if memory_budget < 1:  # the knapsack runs only below 1
        config.update({
            "activation_memory_budget": float(memory_budget),
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


@register_flop_formula(torch.ops.graphopt.lora_linear)
def _lora_linear_flops(x_shape, weight_shape, bias_shape, lora_a_shape, lora_b_shape, *args, **kwargs):
    rows, (out_features, in_features), rank = _rows(x_shape), weight_shape, lora_a_shape[0]
    return 2 * rows * out_features * in_features + 2 * rows * rank * (in_features + out_features)


@register_flop_formula(torch.ops.graphopt.linear_cross_entropy)
def _linear_cross_entropy_flops(hidden_shape, weight_shape, bias_shape, target_shape, ignore_index, reduction,
                                softcap, chunk_rows, grad_hidden, grad_weight, **kwargs):
    rows, (vocab, hidden) = hidden_shape[0], weight_shape
    return 2 * rows * vocab * hidden * (1 + grad_hidden + grad_weight)  # logits, then each gradient asked for
