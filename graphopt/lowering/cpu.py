"""CPU target: graphopt ops decompose into aten below autograd, so Inductor's C++ backend fuses them into
its generated code while each op's hand-written backward formula stays; lora_down, lora_linear, lora_linear_4bit,
linear_cross_entropy and linear_logprobs stay opaque (below)."""

import torch

from graphopt.lowering import direct, ops
from graphopt.kernels import masked_attention_cpu, reference

# lora_linear stays one opaque op: decomposed, Inductor's partitioner chose to save the adapter-dtype (fp32)
# copy of x again, the memory the op exists to avoid; opaque, the backward saves x in its own dtype. lora_down
# stays one too, so that the partition rules that name it (passes/recompute.py) find it on every target.
LORA_OPAQUE = "kernels/reference.py matmuls as one op (saves x in its own dtype, not an fp32 copy)"
LORA_DOWN_OPAQUE = "kernels/reference.py matmul as one op (x·Aᵀ, kept for the backward)"

# lora_linear_4bit stays one opaque op too, and so dequantizes its base inside the call: the weight is never kept.
LORA_4BIT_OPAQUE = ("bitsandbytes' dequantize_4bit of the base (in x's dtype) into a temporary, then kernels/"
                    "reference.py matmuls, as one op: the dequantized weight is never kept")

# linear_cross_entropy stays one opaque op everywhere: its chunk loop is what keeps the logits from existing whole.
LINEAR_CE_OPAQUE = ("kernels/reference.py, one chunk of rows at a time: lm_head matmul, fp32 log-softmax and its "
                    "gradient; the [tokens × vocab] logits never exist at once")
# linear_logprobs and its backward stay opaque for the same reason.
LINEAR_LOGPROBS_OPAQUE = ("kernels/reference.py, one chunk of rows at a time: lm_head matmul, fp32 statistics of the "
                          "next-token distribution; the [tokens × vocab] logits never exist at once")
LINEAR_LOGPROBS_BACKWARD_OPAQUE = ("kernels/reference.py, one chunk of rows at a time: the logits recomputed, their "
                                   "gradient, dX and dW accumulated in fp32")

_REFERENCES = {
    torch.ops.graphopt.rms_norm.default: reference.rms_norm,
    torch.ops.graphopt.rms_norm_backward.default: reference.rms_norm_backward,
    torch.ops.graphopt.gated_activation.default: reference.gated_activation,
    torch.ops.graphopt.gated_activation_backward.default: reference.gated_activation_backward,
    torch.ops.graphopt.rope.default: reference.rope,
    torch.ops.graphopt.rope_backward.default: reference.rope_backward,
    torch.ops.graphopt.linear_cross_entropy_backward.default: reference.linear_cross_entropy_backward,
}
# The masked attention ops decompose into aten's CPU flash-attention kernels, not into the reference's materialized
# fp32 scores (kernels/masked_attention_cpu.py).
ATTENTION = {
    torch.ops.graphopt.padded_attention.default: masked_attention_cpu.padded_attention,
    torch.ops.graphopt.padded_attention_backward.default: masked_attention_cpu.padded_attention_backward,
    torch.ops.graphopt.packed_attention.default: masked_attention_cpu.packed_attention,
    torch.ops.graphopt.packed_attention_backward.default: masked_attention_cpu.packed_attention_backward,
}
_DECOMPOSED = "aten decomposition of kernels/reference.py, compiled by Inductor (C++)"
_FLASH = ("aten's CPU flash-attention kernel with the mask (kernels/masked_attention_cpu.py), in the graph Inductor "
          "compiles")
DECOMPOSITIONS = _REFERENCES | ATTENTION
IMPLEMENTATIONS = {op: _DECOMPOSED for op in _REFERENCES} | {op: _FLASH for op in ATTENTION} | {
    torch.ops.graphopt.lora_down.default: LORA_DOWN_OPAQUE} | {
    op: LORA_OPAQUE for op in (torch.ops.graphopt.lora_linear.default, torch.ops.graphopt.lora_linear_backward.default)
} | {
    op: LORA_4BIT_OPAQUE for op in (torch.ops.graphopt.lora_linear_4bit.default,
                                    torch.ops.graphopt.lora_linear_4bit_backward.default)
} | {torch.ops.graphopt.linear_cross_entropy.default: LINEAR_CE_OPAQUE,
     torch.ops.graphopt.linear_logprobs.default: LINEAR_LOGPROBS_OPAQUE,
     torch.ops.graphopt.linear_logprobs_backward.default: LINEAR_LOGPROBS_BACKWARD_OPAQUE}


def direct_calls() -> dict:
    """The direct calls of compiled graphs (lowering/direct.py) for the ops that stay opaque: each op's own body
    (its check and kernels/reference.py), which custom_op keeps as the function it was defined from."""
    opaque = [op for op in ops.ALL_OPS if op not in DECOMPOSITIONS]
    return direct.define("cpu", "CPU", {op: getattr(ops, op._schema.name.split("::")[1])._init_fn for op in opaque})
