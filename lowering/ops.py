"""The contract: every graphopt:: op, its shape-only fake implementation and its autograd wiring.

The body of each op is the pure-torch reference (kernels/reference.py), so any device can run it; targets
register faster implementations for their device type (lowering/cuda.py) or decompositions (lowering/cpu.py).
A forward op's backward is itself one graphopt:: op, so backward graphs stay one node per fused op.
"""

from typing import Optional

import torch
from torch import Tensor

from graphopt.kernels import reference


# --- rms_norm -------------------------------------------------------------------------------------------

@torch.library.custom_op("graphopt::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float, out_dtype: torch.dtype) -> Tensor:
    """x * rsqrt(mean(x², -1) + eps) * (weight + weight_offset), fp32 math, one rounding to out_dtype.
    Outputs are contiguous whatever the input's layout (as the fake says and the kernels write)."""
    check_rms_norm(x, weight)
    return reference.rms_norm(x, weight, eps, weight_offset, out_dtype).contiguous()


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps, weight_offset, out_dtype):
    check_rms_norm(x, weight)
    return x.new_empty(x.shape, dtype=out_dtype)


def check_rms_norm(x, weight, compute_weight_grad=False):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    if weight is not None:
        torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                     lambda: f"rms_norm: weight of shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    torch._check(weight is not None or not compute_weight_grad,
                 lambda: "rms_norm_backward: compute_weight_grad=True needs a weight")


@torch.library.custom_op("graphopt::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad_out: Tensor, x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float, compute_weight_grad: bool
) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_weight); grad_weight is an empty tensor when compute_weight_grad is False."""
    check_rms_norm(x, weight, compute_weight_grad)
    grad_x, grad_w = reference.rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad)
    return grad_x.contiguous(), grad_w


@rms_norm_backward.register_fake
def _rms_norm_backward_fake(grad_out, x, weight, eps, weight_offset, compute_weight_grad):
    check_rms_norm(x, weight, compute_weight_grad)
    grad_w = weight.new_empty(weight.shape) if compute_weight_grad else x.new_empty(0)
    return x.new_empty(x.shape), grad_w


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps, weight_offset, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _rms_norm_grad(ctx, grad_out):
    x, weight = ctx.saved_tensors
    # A frozen norm weight (the LoRA case) skips the dW reduction entirely.
    compute_weight_grad = weight is not None and ctx.needs_input_grad[1]
    grad_x, grad_w = torch.ops.graphopt.rms_norm_backward(
        grad_out, x, weight, ctx.eps, ctx.weight_offset, compute_weight_grad
    )
    return grad_x, (grad_w if compute_weight_grad else None), None, None, None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup_context)


# --- gated_activation (SwiGLU, GeGLU) ----------------------------------------------------------------------

@torch.library.custom_op("graphopt::gated_activation", mutates_args=())
def gated_activation(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """act(gate) * up in fp32 math, act = "silu" (SwiGLU) or "gelu_tanh" (GeGLU); contiguous output."""
    check_gated_activation(gate, up, activation)
    return reference.gated_activation(gate, up, activation).contiguous()


@gated_activation.register_fake
def _gated_activation_fake(gate, up, activation):
    check_gated_activation(gate, up, activation)
    return gate.new_empty(gate.shape)


@torch.library.custom_op("graphopt::gated_activation_backward", mutates_args=())
def gated_activation_backward(grad_out: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(grad_gate, grad_up); act(gate) is recomputed, never saved."""
    check_gated_activation(gate, up, activation)
    grad_gate, grad_up = reference.gated_activation_backward(grad_out, gate, up, activation)
    return grad_gate.contiguous(), grad_up.contiguous()


@gated_activation_backward.register_fake
def _gated_activation_backward_fake(grad_out, gate, up, activation):
    check_gated_activation(gate, up, activation)
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def check_gated_activation(gate, up, activation):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    torch._check(activation in reference.GATED_ACTIVATIONS,
                 lambda: f"gated_activation: activation {activation!r} is not one of {reference.GATED_ACTIVATIONS}")
    torch._check(gate.shape == up.shape and gate.dtype == up.dtype,
                 lambda: f"gated_activation: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} must have one shape and dtype")


def _gated_setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _gated_grad(ctx, grad_out):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = torch.ops.graphopt.gated_activation_backward(grad_out, gate, up, ctx.activation)
    return grad_gate, grad_up, None


gated_activation.register_autograd(_gated_grad, setup_context=_gated_setup_context)


# --- lora_linear (PEFT LoRA Linear) -----------------------------------------------------------------------

@torch.library.custom_op("graphopt::lora_linear", mutates_args=())
def lora_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora_a: Tensor, lora_b: Tensor, scaling: float,
                out_dtype: torch.dtype) -> Tensor:
    """Frozen base linear plus LoRA path, PEFT's operations and dtypes; the backward gives dX, dA, dB only."""
    check_lora_linear(x, weight, lora_a, lora_b)
    return reference.lora_linear(x, weight, bias, lora_a, lora_b, scaling, out_dtype).contiguous()


@lora_linear.register_fake
def _lora_linear_fake(x, weight, bias, lora_a, lora_b, scaling, out_dtype):
    check_lora_linear(x, weight, lora_a, lora_b)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("graphopt::lora_linear_backward", mutates_args=())
def lora_linear_backward(grad_out: Tensor, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                         scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_a, grad_b); the adapter-dtype copy of x is recomputed, so only x itself is saved."""
    check_lora_linear(x, weight, lora_a, lora_b)
    grads = reference.lora_linear_backward(grad_out, x, weight, lora_a, lora_b, scaling)
    return tuple(g.contiguous() for g in grads)


@lora_linear_backward.register_fake
def _lora_linear_backward_fake(grad_out, x, weight, lora_a, lora_b, scaling):
    check_lora_linear(x, weight, lora_a, lora_b)
    return x.new_empty(x.shape), lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


def check_lora_linear(x, weight, lora_a, lora_b):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    torch._check(weight.dim() == 2 and lora_a.dim() == 2 and lora_b.dim() == 2,
                 lambda: "lora_linear: weight, lora_a and lora_b must be matrices")
    torch._check(x.shape[-1] == weight.shape[1] and lora_a.shape[1] == weight.shape[1]
                 and lora_b.shape[0] == weight.shape[0] and lora_b.shape[1] == lora_a.shape[0],
                 lambda: f"lora_linear: shapes do not chain: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}")


def _lora_setup_context(ctx, inputs, output):
    x, weight, bias, lora_a, lora_b, scaling, _ = inputs
    ctx.save_for_backward(x, weight, lora_a, lora_b)
    ctx.scaling = scaling


def _lora_grad(ctx, grad_out):
    x, weight, lora_a, lora_b = ctx.saved_tensors
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError("graphopt::lora_linear computes no gradient for the base weight or bias: they must be "
                           "frozen (requires_grad=False), as PEFT leaves them; the fusion pass never fuses otherwise")
    grad_x, grad_a, grad_b = torch.ops.graphopt.lora_linear_backward(grad_out, x, weight, lora_a, lora_b, ctx.scaling)
    return grad_x, None, None, grad_a, grad_b, None, None


lora_linear.register_autograd(_lora_grad, setup_context=_lora_setup_context)


# Forward op → its backward op, for the report and the lowerings.
BACKWARD_OF = {
    torch.ops.graphopt.rms_norm.default: torch.ops.graphopt.rms_norm_backward.default,
    torch.ops.graphopt.gated_activation.default: torch.ops.graphopt.gated_activation_backward.default,
    torch.ops.graphopt.lora_linear.default: torch.ops.graphopt.lora_linear_backward.default,
}
ALL_OPS = [op for pair in BACKWARD_OF.items() for op in pair]
