"""A CPU stand-in for the torch_npu fused operators lowering/ascend.py uses, with their exact schemas (from
libtorch_npu, ../shared/DESIGN.md), so the Ascend lowering runs end to end on a machine without an NPU. Defined
only when torch_npu is absent: never install torch-npu where CANN is missing (it breaks `import torch`).

Semantics, in fp32 math, as Ascend documents them:
  npu_rms_norm(x, gamma, eps)            → (x·rstd·gamma in x's dtype, rstd fp32 over gamma's trailing dims)
  npu_rms_norm_backward(dy, x, gamma, rstd) → (dx in x's dtype, dgamma fp32)
  npu_rotary_mul(x, r1, r2, "half")      → x·r1 + rotate_half(x)·r2, rotate_half(x) = cat(−x2, x1)
  npu_rotary_mul_backward(g, x, r1, r2, "half") → (dx, dr1, dr2)
  npu_swiglu(x, dim)                     → silu(a)·b, (a, b) = x split in two halves along dim
  npu_swiglu_backward(g, x, dim)         → d x
  npu_cross_entropy_loss(z, t, ...)      → (loss, log_softmax(z), zloss, lse_for_zloss); rows with t = ignore_index
                                            count for nothing; "mean" divides by the valid rows
"""

import importlib.util

import torch

SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": "npu_rms_norm_backward(Tensor dy, Tensor input, Tensor gamma, Tensor rstd) -> "
                             "(Tensor, Tensor)",
    "npu_rotary_mul": "npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', "
                      "Tensor? rotate=None) -> Tensor",
    "npu_rotary_mul_backward": "npu_rotary_mul_backward(Tensor grad, Tensor input, Tensor r1, Tensor r2, "
                               "str rotary_mode='half') -> (Tensor, Tensor, Tensor)",
    "npu_swiglu": "npu_swiglu(Tensor input, int dim=-1) -> Tensor",
    "npu_swiglu_backward": "npu_swiglu_backward(Tensor grad_output, Tensor input, int dim=-1) -> Tensor",
    "npu_cross_entropy_loss": "npu_cross_entropy_loss(Tensor input, Tensor target, Tensor? weight=None, "
                              "str reduction='mean', int ignore_index=-100, float label_smoothing=0.0, "
                              "float lse_square_scale_for_zloss=0.0, bool return_zloss=False) -> "
                              "(Tensor, Tensor, Tensor, Tensor)",
}


def _rstd(x, gamma, eps):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    return torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)


def npu_rms_norm(x, gamma, epsilon=1e-6):
    rstd = _rstd(x, gamma, epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm_backward(dy, x, gamma, rstd):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x_hat = x.float() * rstd
    g = dy.float() * gamma.float()
    dx = rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))
    dgamma = (dy.float() * x_hat).sum(tuple(range(x.dim() - gamma.dim())))
    return dx.to(x.dtype), dgamma


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _check_mode(rotary_mode):
    if rotary_mode != "half":
        raise NotImplementedError(f"stand-in npu_rotary_mul: rotary_mode={rotary_mode!r} (only 'half')")


def npu_rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    _check_mode(rotary_mode)
    y = x.float() * r1.float() + _rotate_half(x.float()) * r2.float()
    return y.to(x.dtype)


def _sum_to(t, shape):
    dims = [i for i, (a, b) in enumerate(zip(t.shape, shape)) if b == 1 and a != 1]
    return t.sum(dims, keepdim=True) if dims else t


def npu_rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    _check_mode(rotary_mode)
    g, xf = grad.float(), x.float()
    g1, g2 = (g * r2.float()).chunk(2, dim=-1)
    dx = g * r1.float() + torch.cat([g2, -g1], dim=-1)  # the transpose of rotate_half
    dr1 = _sum_to(g * xf, r1.shape)
    dr2 = _sum_to(g * _rotate_half(xf), r2.shape)
    return dx.to(x.dtype), dr1.to(r1.dtype), dr2.to(r2.dtype)


def npu_swiglu(x, dim=-1):
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def npu_swiglu_backward(grad_output, x, dim=-1):
    a, b = x.float().chunk(2, dim=dim)
    s = torch.sigmoid(a)
    g = grad_output.float()
    return torch.cat([g * b * s * (1 + a * (1 - s)), g * a * s], dim=dim).to(x.dtype)


def npu_cross_entropy_loss(z, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                           lse_square_scale_for_zloss=0.0, return_zloss=False):
    if weight is not None or label_smoothing or lse_square_scale_for_zloss or return_zloss:
        raise NotImplementedError("stand-in npu_cross_entropy_loss: no class weights, smoothing or z-loss")
    log_prob = torch.log_softmax(z.float(), dim=-1)
    valid = target != ignore_index
    picked = log_prob.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1)
    losses = torch.where(valid, -picked, torch.zeros_like(picked))
    loss = losses.sum() / valid.sum() if reduction == "mean" else losses.sum() if reduction == "sum" else losses
    return loss, log_prob, z.new_empty(0, dtype=torch.float32), z.new_empty(0, dtype=torch.float32)


def define():
    """Define torch.ops.npu.* on the CPU when torch_npu is absent; returns the Library (keep it alive)."""
    if importlib.util.find_spec("torch_npu") is not None:
        raise RuntimeError("torch_npu is installed: test against it, not against the stand-in")
    library = torch.library.Library("npu", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        library.define(schema)
        library.impl(name, globals()[name], "CPU")
        # the same torch code computes the output shapes on fake tensors
        torch.library.register_fake(f"npu::{name}", globals()[name], lib=library)
    return library
