"""Ascend NPU target: graphopt ops → torch_npu's fused operators (torch.ops.npu.*), composed where no single
operator exists. The graph around them runs eagerly (aot_autograd without Inductor).

  rms_norm                 npu_rms_norm; backward npu_rms_norm_backward with rstd from npu_rms_norm
  rope                     npu_rotary_mul ("half" mode, HF's rotate_half) on the rotated channels, the rest passed
                           through (Phi-3's partial rotary); backward npu_rotary_mul_backward (its dx does not read
                           the input, so the gradient stands in for it)
  gated_activation silu    npu_swiglu over cat(gate, up); backward npu_swiglu_backward. GeGLU has no fused
                           operator: the reference
  linear_cross_entropy     per chunk of rows: the lm_head matmul, then npu_cross_entropy_loss (sum over the
                           chunk), the gradient from its log-probabilities; the logits never exist whole
  lora_down, lora_linear,  matmuls and pointwise ops: the reference (kernels/reference.py)
  its backward
  linear_logprobs          the reference, one chunk of rows at a time (no torch_npu operator returns the entropy or
                           the other statistics; npu_cross_entropy_loss gives only the log-probabilities)

torch_npu is never imported here: with it installed, torch.ops.npu.* exist; without it (CI), tests define a
stand-in with the exact schemas (tests/npu_standin.py). Not yet run on Ascend hardware: the operators' layout
rules there (which broadcasts of cos/sin npu_rotary_mul accepts, gamma's dtype) are checked only by the stand-in.
"""

import torch

from graphopt.kernels import reference
from graphopt.lowering import ops

_FUSED = "torch_npu fused operator"

IMPLEMENTATIONS = {
    torch.ops.graphopt.rms_norm.default: f"{_FUSED} npu_rms_norm",
    torch.ops.graphopt.rms_norm_backward.default: f"{_FUSED} npu_rms_norm_backward (rstd from npu_rms_norm)",
    torch.ops.graphopt.rope.default: f"{_FUSED} npu_rotary_mul (half mode), q and k",
    torch.ops.graphopt.rope_backward.default: f"{_FUSED} npu_rotary_mul_backward",
    torch.ops.graphopt.gated_activation.default: f"{_FUSED} npu_swiglu (GeGLU: pure-torch reference)",
    torch.ops.graphopt.gated_activation_backward.default: f"{_FUSED} npu_swiglu_backward (GeGLU: reference)",
    torch.ops.graphopt.linear_cross_entropy.default: f"lm_head matmul + {_FUSED} npu_cross_entropy_loss, one chunk "
                                                     "of rows at a time (logits never whole)",
    torch.ops.graphopt.linear_cross_entropy_backward.default: "pure-torch reference (scales the forward's gradients)",
    torch.ops.graphopt.lora_down.default: "pure-torch reference (kernels/reference.py matmul)",
    torch.ops.graphopt.lora_linear.default: "pure-torch reference (kernels/reference.py matmuls)",
    torch.ops.graphopt.lora_linear_backward.default: "pure-torch reference (kernels/reference.py matmuls)",
    torch.ops.graphopt.linear_logprobs.default: "pure-torch reference, one chunk of rows at a time (logits not whole)",
    torch.ops.graphopt.linear_logprobs_backward.default: "pure-torch reference, one chunk of rows at a time",
}


def _gamma(weight, weight_offset, x):
    if weight is None:
        return torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return (weight.float() + weight_offset).to(x.dtype)


def _rms_norm(x, weight, eps, weight_offset, out_dtype):
    ops.check_rms_norm(x, weight)
    source = x if out_dtype == x.dtype else x.float()  # the operator rounds to its input's dtype
    y, _ = torch.ops.npu.npu_rms_norm(source, _gamma(weight, weight_offset, source), eps)
    return y.to(out_dtype)


def _rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad):
    ops.check_rms_norm(x, weight, compute_weight_grad)
    gamma = _gamma(weight, weight_offset, x)
    _, rstd = torch.ops.npu.npu_rms_norm(x, gamma, eps)
    grad_x, grad_gamma = torch.ops.npu.npu_rms_norm_backward(grad_out.to(x.dtype), x, gamma, rstd)
    grad_w = grad_gamma.to(weight.dtype) if compute_weight_grad else x.new_empty(0)
    return grad_x, grad_w


def _rotate(x, cos, sin):
    rot = cos.shape[-1]
    r1, r2 = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # [B or 1, 1, S, R] over the heads
    rotated = torch.ops.npu.npu_rotary_mul(x[..., :rot], r1, r2, "half")
    return (rotated if rot == x.shape[-1] else torch.cat([rotated, x[..., rot:]], dim=-1)).contiguous()


def _rotate_back(grad, cos, sin):
    rot = cos.shape[-1]
    r1, r2 = cos.unsqueeze(1).to(grad.dtype), sin.unsqueeze(1).to(grad.dtype)
    part = grad[..., :rot]
    grad_x, _, _ = torch.ops.npu.npu_rotary_mul_backward(part, part, r1, r2, "half")
    return (grad_x if rot == grad.shape[-1] else torch.cat([grad_x, grad[..., rot:]], dim=-1)).contiguous()


def _rope(q, k, cos, sin):
    ops.check_rope(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rope_backward(grad_q, grad_k, cos, sin):
    ops.check_rope(grad_q, grad_k, cos, sin)
    return _rotate_back(grad_q, cos, sin), _rotate_back(grad_k, cos, sin)


def _gated_activation(gate, up, activation):
    ops.check_gated_activation(gate, up, activation)
    if activation != "silu":
        return reference.gated_activation(gate, up, activation)
    return torch.ops.npu.npu_swiglu(torch.cat([gate, up], dim=-1), -1)


def _gated_activation_backward(grad_out, gate, up, activation):
    ops.check_gated_activation(gate, up, activation)
    if activation != "silu":
        return reference.gated_activation_backward(grad_out, gate, up, activation)
    grad = torch.ops.npu.npu_swiglu_backward(grad_out, torch.cat([gate, up], dim=-1), -1)
    grad_gate, grad_up = grad.chunk(2, dim=-1)
    return grad_gate.contiguous(), grad_up.contiguous()


def _npu_chunk_loss(z, target, keep, ignore_index):
    chunk_sum, log_prob, _, _ = torch.ops.npu.npu_cross_entropy_loss(z, target, None, "sum", ignore_index)
    return chunk_sum, log_prob


def _linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows, grad_hidden,
                          grad_weight):
    """kernels/reference.py's chunk loop, each chunk's loss and log-probabilities from npu_cross_entropy_loss."""
    ops.check_linear_cross_entropy(hidden, weight, bias, target, reduction, chunk_rows)
    fused = hidden.dtype != torch.float64  # no fp64 on the NPU; the op's contract computes fp64 in fp64
    return reference.linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows,
                                          grad_hidden, grad_weight,
                                          chunk_loss=_npu_chunk_loss if fused else reference.chunk_loss)


KERNELS = {
    "rms_norm": _rms_norm,
    "rms_norm_backward": _rms_norm_backward,
    "rope": _rope,
    "rope_backward": _rope_backward,
    "gated_activation": _gated_activation,
    "gated_activation_backward": _gated_activation_backward,
    "linear_cross_entropy": _linear_cross_entropy,
}


def register(dispatch_key: str = "PrivateUse1") -> torch.library.Library:
    """Register the kernels above for the NPU (torch_npu's PrivateUse1 backend), or another dispatch key in tests.
    The ops without an entry keep their reference implementation. Returns the Library: destroying it unregisters."""
    library = torch.library.Library("graphopt", "IMPL")
    for name, kernel in KERNELS.items():
        library.impl(name, kernel, dispatch_key)
    return library
