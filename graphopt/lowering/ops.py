"""The contract: every graphopt:: op, its shape-only fake implementation and its autograd wiring.

The body of each op is the pure-torch reference (kernels/reference.py), so any device can run it; targets
register faster implementations for their device type (lowering/cuda.py) or decompositions (lowering/cpu.py).
A forward op's backward is itself one graphopt:: op, so backward graphs stay one node per fused op.
"""

from typing import Optional

import torch
from torch import Tensor

from graphopt.kernels import reference
from graphopt.lowering import transfer


def _check(cond, message) -> None:
    """torch._check, returning at once for a plain True: the target kernels check the contract at every call, and
    torch._check's symbolic path costs microseconds a condition in a step the host paces under dynamic shapes."""
    if cond is not True:
        torch._check(cond, message)


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
        _check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
               lambda: f"rms_norm: weight of shape {tuple(weight.shape)} does not match hidden size "
                       f"{x.shape[-1]}")
    _check(weight is not None or not compute_weight_grad,
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
    _check(activation in reference.GATED_ACTIVATIONS,
           lambda: f"gated_activation: activation {activation!r} is not one of {reference.GATED_ACTIVATIONS}")
    _check(gate.shape == up.shape and gate.dtype == up.dtype,
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


# --- rope (rotary position embedding of q and k, HF's rotate_half form) ------------------------------------

@torch.library.custom_op("graphopt::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(q, k) rotated on their first R = cos.shape[-1] channels, the rest passed through, fp32 math; q [B, Hq, S, D],
    k [B, Hk, S, D], cos/sin [B or 1, S, R] (before HF's unsqueeze over heads). Contiguous outputs in q's and k's
    dtypes, whatever the inputs' strides."""
    check_rope(q, k, cos, sin)
    q_out, k_out = reference.rope(q, k, cos, sin)
    return q_out.contiguous(), k_out.contiguous()


@rope.register_fake
def _rope_fake(q, k, cos, sin):
    check_rope(q, k, cos, sin)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("graphopt::rope_backward", mutates_args=())
def rope_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_q, grad_k) through the transposed rotation; nothing but cos and sin is saved for it."""
    check_rope(grad_q, grad_k, cos, sin)
    grad_q, grad_k = reference.rope_backward(grad_q, grad_k, cos, sin)
    return grad_q.contiguous(), grad_k.contiguous()


@rope_backward.register_fake
def _rope_backward_fake(grad_q, grad_k, cos, sin):
    check_rope(grad_q, grad_k, cos, sin)
    return grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape)


def check_rope(q, k, cos, sin):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    _check(q.dim() == 4 and k.dim() == 4,
           lambda: f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [batch, heads, seq, head_dim]")
    _check(q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.shape[3] == k.shape[3],
           lambda: f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or head_dim")
    _check(cos.dim() == 3 and cos.shape == sin.shape and cos.dtype == sin.dtype,
           lambda: f"rope: cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} must be "
                   "[batch or 1, seq, rotary_dim] of one dtype")
    _check((cos.shape[0] == 1 or cos.shape[0] == q.shape[0]) and cos.shape[1] == q.shape[2],
           lambda: f"rope: cos/sin {tuple(cos.shape)} do not broadcast over q {tuple(q.shape)}: "
                   "[batch or 1, seq, rotary_dim] expected")
    _check(cos.shape[2] % 2 == 0 and 0 < cos.shape[2] <= q.shape[3],
           lambda: f"rope: rotary_dim {cos.shape[2]} must be even and within head_dim {q.shape[3]}")
    for name, t in (("q", q), ("k", k), ("cos", cos)):
        _check(t.dtype.is_floating_point, lambda: f"rope: {name} has dtype {t.dtype}, not a float dtype")


def _rope_setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rope_grad(ctx, grad_q, grad_k):
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise RuntimeError("graphopt::rope computes no gradient for cos or sin: they must not require grad (HF's are "
                           "computed from a buffer); the fusion pass never fuses otherwise")
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = torch.ops.graphopt.rope_backward(grad_q, grad_k, cos, sin)
    return grad_q, grad_k, None, None


rope.register_autograd(_rope_grad, setup_context=_rope_setup_context)


# --- lora_down, lora_linear (PEFT LoRA Linear) -----------------------------------------------------------
# A LoRA linear is two ops: lora_down, x·Aᵀ [..., rank] (the adapters' input dropped, in their dtype), and
# lora_linear, which takes that product as an input and adds ·Bᵀ, the scaling and the frozen base. The backward
# reads x·Aᵀ as saved, as PEFT's autograd does; as its own node in the graph it is saved on its own ([tokens, rank]:
# a few hundred KiB) while the partitioner recomputes the linear's output, where one op of two outputs would be
# recomputed whole for it. lora_linear's backward differentiates through x·Aᵀ itself (dX and dA include its path):
# x·Aᵀ carries no gradient, and lora_down's output needs none.

@torch.library.custom_op("graphopt::lora_down", mutates_args=())
def lora_down(x: Tensor, lora_a: Tensor, dropout_mask: Optional[Tensor] = None, dropout_p: float = 0.0) -> Tensor:
    """xa = drop(x as lora_a's dtype)·Aᵀ [..., rank]: the input lora_linear takes as xa (kernels/reference.py)."""
    check_lora_down(x, lora_a, dropout_mask, dropout_p)
    return reference.lora_down(x, lora_a, dropout_mask, dropout_p).contiguous()


@lora_down.register_fake
def _lora_down_fake(x, lora_a, dropout_mask=None, dropout_p=0.0):
    check_lora_down(x, lora_a, dropout_mask, dropout_p)
    return x.new_empty((*x.shape[:-1], lora_a.shape[0]), dtype=lora_a.dtype)


def check_lora_down(x, lora_a, dropout_mask=None, dropout_p=0.0, op="lora_down"):
    """The input contract of lora_down and of the adapters' part of lora_linear."""
    _check(lora_a.dim() == 2 and x.shape[-1] == lora_a.shape[1],
           lambda: f"{op}: lora_a {tuple(lora_a.shape)} is not [rank, {x.shape[-1]}] for x {tuple(x.shape)}")
    _check(dropout_mask is None or (dropout_mask.dtype == torch.bool and dropout_mask.shape == x.shape),
           lambda: f"{op}: dropout_mask must be a bool tensor of x's shape {tuple(x.shape)}")
    _check(0.0 <= dropout_p < 1.0, lambda: f"{op}: dropout_p={dropout_p} must be in [0, 1)")


def _lora_down_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


lora_down.register_autograd(lambda ctx, grad_xa: (None, None, None, None), setup_context=_lora_down_setup_context)


@torch.library.custom_op("graphopt::lora_linear", mutates_args=())
def lora_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora_a: Tensor, lora_b: Tensor, xa: Tensor,
                scaling: float, out_dtype: torch.dtype, dropout_mask: Optional[Tensor] = None,
                dropout_p: float = 0.0) -> Tensor:
    """Frozen base linear plus LoRA path, PEFT's operations and dtypes, given xa = lora_down(x, lora_a,
    dropout_mask, dropout_p); the backward gives dX, dA, dB only. With a dropout_mask (bool, x's shape: the elements
    kept), the adapters see x dropped as torch's dropout with probability dropout_p drops it
    (kernels/reference.py)."""
    check_lora_linear(x, weight, lora_a, lora_b, xa, dropout_mask, dropout_p)
    return reference.lora_linear(x, weight, bias, lora_a, lora_b, xa, scaling, out_dtype).contiguous()


@lora_linear.register_fake
def _lora_linear_fake(x, weight, bias, lora_a, lora_b, xa, scaling, out_dtype, dropout_mask=None, dropout_p=0.0):
    check_lora_linear(x, weight, lora_a, lora_b, xa, dropout_mask, dropout_p)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("graphopt::lora_linear_backward", mutates_args=())
def lora_linear_backward(grad_out: Tensor, x: Tensor, xa: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                         scaling: float, dropout_mask: Optional[Tensor] = None,
                         dropout_p: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_a, grad_b) from x and the forward's xa; the adapter-dtype copy of x is recomputed (through the
    same dropout mask), so only x itself, xa and the mask are saved."""
    check_lora_linear(x, weight, lora_a, lora_b, xa, dropout_mask, dropout_p)
    grads = reference.lora_linear_backward(grad_out, x, xa, weight, lora_a, lora_b, scaling, dropout_mask, dropout_p)
    return tuple(g.contiguous() for g in grads)


@lora_linear_backward.register_fake
def _lora_linear_backward_fake(grad_out, x, xa, weight, lora_a, lora_b, scaling, dropout_mask=None, dropout_p=0.0):
    check_lora_linear(x, weight, lora_a, lora_b, xa, dropout_mask, dropout_p)
    return x.new_empty(x.shape), lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


def check_lora_linear(x, weight, lora_a, lora_b, xa, dropout_mask=None, dropout_p=0.0, op="lora_linear"):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it. weight: the base
    weight, or its shape (lora_linear_4bit)."""
    shape = tuple(weight.shape) if isinstance(weight, Tensor) else tuple(weight)
    check_lora_down(x, lora_a, dropout_mask, dropout_p, op)
    _check(len(shape) == 2 and lora_b.dim() == 2,
           lambda: f"{op}: weight and lora_b must be matrices")
    _check(x.shape[-1] == shape[1] and lora_b.shape[0] == shape[0] and lora_b.shape[1] == lora_a.shape[0],
           lambda: f"{op}: shapes do not chain: x {tuple(x.shape)}, weight {shape}, "
                   f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}")
    _check(xa.shape == (*x.shape[:-1], lora_a.shape[0]) and xa.dtype == lora_a.dtype,
           lambda: f"{op}: xa {tuple(xa.shape)} {xa.dtype} is not lora_down's x·Aᵀ "
                   f"{(*x.shape[:-1], lora_a.shape[0])} {lora_a.dtype}")


def _lora_setup_context(ctx, inputs, output):
    x, weight, bias, lora_a, lora_b, xa, scaling, _, dropout_mask, dropout_p = inputs
    ctx.save_for_backward(x, xa, weight, lora_a, lora_b, dropout_mask)
    ctx.scaling, ctx.dropout_p = scaling, dropout_p


def _lora_grad(ctx, grad_out):
    x, xa, weight, lora_a, lora_b, dropout_mask = ctx.saved_tensors
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError("graphopt::lora_linear computes no gradient for the base weight or bias: they must be "
                           "frozen (requires_grad=False), as PEFT leaves them; the fusion pass never fuses otherwise")
    grad_x, grad_a, grad_b = torch.ops.graphopt.lora_linear_backward(grad_out, x, xa, weight, lora_a, lora_b,
                                                                     ctx.scaling, dropout_mask, ctx.dropout_p)
    return grad_x, None, None, grad_a, grad_b, None, None, None, None, None


lora_linear.register_autograd(_lora_grad, setup_context=_lora_setup_context)


# --- lora_linear_4bit (PEFT LoRA around a bitsandbytes 4-bit base: QLoRA) -----------------------------------------

QUANT_TYPES = ("nf4", "fp4")


@torch.library.custom_op("graphopt::lora_linear_4bit", mutates_args=())
def lora_linear_4bit(x: Tensor, packed: Tensor, shape: list[int], absmax: Tensor, blocksize: int, quant_type: str,
                     bias: Optional[Tensor], absmax_8bit: Optional[Tensor], absmax_code: Optional[Tensor],
                     absmax_offset: Optional[Tensor], lora_a: Tensor, lora_b: Tensor, xa: Tensor, scaling: float,
                     out_dtype: torch.dtype, dropout_mask: Optional[Tensor] = None, dropout_p: float = 0.0) -> Tensor:
    """lora_linear over a frozen bitsandbytes 4-bit base, given as bitsandbytes::gemm_4bit takes it: packed codes
    (uint8, two a byte), the weight's [out, in] shape, the absmax (with double quantization the nested absmax, then
    absmax_8bit, absmax_code and absmax_offset), the block size and quant type. The base is dequantized in x's
    dtype for each call and never kept; the backward gives dX, dA, dB only (kernels/reference.py)."""
    check_lora_linear_4bit(x, packed, shape, blocksize, quant_type, lora_a, lora_b, xa, dropout_mask, dropout_p)
    return reference.lora_linear_4bit(x, packed, shape, absmax, blocksize, quant_type, bias, absmax_8bit,
                                      absmax_code, absmax_offset, lora_a, lora_b, xa, scaling,
                                      out_dtype).contiguous()


@lora_linear_4bit.register_fake
def _lora_linear_4bit_fake(x, packed, shape, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code,
                           absmax_offset, lora_a, lora_b, xa, scaling, out_dtype, dropout_mask=None, dropout_p=0.0):
    check_lora_linear_4bit(x, packed, shape, blocksize, quant_type, lora_a, lora_b, xa, dropout_mask, dropout_p)
    return x.new_empty((*x.shape[:-1], shape[0]), dtype=out_dtype)


@torch.library.custom_op("graphopt::lora_linear_4bit_backward", mutates_args=())
def lora_linear_4bit_backward(grad_out: Tensor, x: Tensor, xa: Tensor, packed: Tensor, shape: list[int],
                              absmax: Tensor, blocksize: int, quant_type: str, absmax_8bit: Optional[Tensor],
                              absmax_code: Optional[Tensor], absmax_offset: Optional[Tensor], lora_a: Tensor,
                              lora_b: Tensor, scaling: float, dropout_mask: Optional[Tensor] = None,
                              dropout_p: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_a, grad_b) from x and the forward's xa: the base dequantized again, never saved by the
    forward."""
    check_lora_linear_4bit(x, packed, shape, blocksize, quant_type, lora_a, lora_b, xa, dropout_mask, dropout_p)
    grads = reference.lora_linear_4bit_backward(grad_out, x, xa, packed, shape, absmax, blocksize, quant_type,
                                                absmax_8bit, absmax_code, absmax_offset, lora_a, lora_b, scaling,
                                                dropout_mask, dropout_p)
    return tuple(g.contiguous() for g in grads)


@lora_linear_4bit_backward.register_fake
def _lora_linear_4bit_backward_fake(grad_out, x, xa, packed, shape, absmax, blocksize, quant_type, absmax_8bit,
                                    absmax_code, absmax_offset, lora_a, lora_b, scaling, dropout_mask=None,
                                    dropout_p=0.0):
    check_lora_linear_4bit(x, packed, shape, blocksize, quant_type, lora_a, lora_b, xa, dropout_mask, dropout_p)
    return x.new_empty(x.shape), lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


def check_lora_linear_4bit(x, packed, shape, blocksize, quant_type, lora_a, lora_b, xa, dropout_mask=None,
                           dropout_p=0.0):
    """The op's input contract; every implementation checks it."""
    _check(len(shape) == 2 and packed.dtype == torch.uint8
           and packed.numel() == (shape[0] * shape[1] + 1) // 2,
           lambda: f"lora_linear_4bit: packed must hold the {shape} weight's 4-bit codes two a byte (uint8), "
                   f"got {packed.dtype} of {packed.numel()} elements")
    _check(quant_type in QUANT_TYPES and blocksize >= 2 and blocksize & (blocksize - 1) == 0,
           lambda: f"lora_linear_4bit: quant_type {quant_type!r} must be one of {QUANT_TYPES}, blocksize "
                   f"{blocksize} a power of 2 (bitsandbytes makes 32 to 4096)")
    check_lora_linear(x, shape, lora_a, lora_b, xa, dropout_mask, dropout_p, op="lora_linear_4bit")


def _lora_4bit_setup_context(ctx, inputs, output):
    (x, packed, shape, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset, lora_a, lora_b,
     xa, scaling, _, dropout_mask, dropout_p) = inputs
    ctx.save_for_backward(x, xa, packed, absmax, absmax_8bit, absmax_code, absmax_offset, lora_a, lora_b,
                          dropout_mask)
    ctx.shape, ctx.blocksize, ctx.quant_type, ctx.scaling, ctx.dropout_p = shape, blocksize, quant_type, scaling, \
        dropout_p


def _lora_4bit_grad(ctx, grad_out):
    x, xa, packed, absmax, absmax_8bit, absmax_code, absmax_offset, lora_a, lora_b, dropout_mask = ctx.saved_tensors
    if ctx.needs_input_grad[6]:
        raise RuntimeError("graphopt::lora_linear_4bit computes no gradient for the base bias: it must be frozen "
                           "(requires_grad=False), as PEFT leaves it; the fusion pass never fuses otherwise")
    grad_x, grad_a, grad_b = torch.ops.graphopt.lora_linear_4bit_backward(
        grad_out, x, xa, packed, ctx.shape, absmax, ctx.blocksize, ctx.quant_type, absmax_8bit, absmax_code,
        absmax_offset, lora_a, lora_b, ctx.scaling, dropout_mask, ctx.dropout_p)
    return (grad_x, *[None] * 9, grad_a, grad_b, None, None, None, None, None)


lora_linear_4bit.register_autograd(_lora_4bit_grad, setup_context=_lora_4bit_setup_context)


# --- linear_cross_entropy (lm_head + loss, logits never materialized) --------------------------------------

@torch.library.custom_op("graphopt::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
                         reduction: str, softcap: float, chunk_rows: int, grad_hidden: bool,
                         grad_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss/d hidden, d loss/d weight) of cross_entropy(hidden·Wᵀ + b, target), computed chunk_rows rows
    at a time; a gradient not asked for is an empty tensor. kernels/reference.py states the exact semantics."""
    check_linear_cross_entropy(hidden, weight, bias, target, reduction, chunk_rows)
    loss, d_hidden, d_weight = reference.linear_cross_entropy(
        hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows, grad_hidden, grad_weight)
    return loss, d_hidden.contiguous(), d_weight.contiguous()


@linear_cross_entropy.register_fake
def _linear_cross_entropy_fake(hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows,
                               grad_hidden, grad_weight):
    check_linear_cross_entropy(hidden, weight, bias, target, reduction, chunk_rows)
    loss = hidden.new_empty((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    return (loss, hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else weight.new_empty(0))


@torch.library.custom_op("graphopt::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad_loss: Tensor, d_hidden: Tensor, d_weight: Tensor) -> tuple[Tensor, Tensor]:
    """The forward's gradients scaled by the incoming one (ignored rows stay zero)."""
    d_hidden, d_weight = reference.linear_cross_entropy_backward(grad_loss, d_hidden, d_weight)
    return d_hidden.contiguous(), d_weight.contiguous()


@linear_cross_entropy_backward.register_fake
def _linear_cross_entropy_backward_fake(grad_loss, d_hidden, d_weight):
    return d_hidden.new_empty(d_hidden.shape), d_weight.new_empty(d_weight.shape)


LOSS_REDUCTIONS = ("mean", "sum")


def check_lm_head(op, hidden, weight, bias, targets):
    """The contract the fused heads share: hidden [tokens, hidden] rows of the lm_head weight [vocab, hidden], a bias
    [vocab] or none, one int64 target per row."""
    _check(hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1],
           lambda: f"{op}: hidden {tuple(hidden.shape)} must be [tokens, hidden] rows of the weight's width "
                   f"{tuple(weight.shape)}")
    _check(bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]),
           lambda: f"{op}: bias must be [vocab]")
    _check(targets.dim() == 1 and targets.shape[0] == hidden.shape[0] and targets.dtype == torch.long,
           lambda: f"{op}: targets {tuple(targets.shape)} {targets.dtype} must be int64, one label per row of "
                   f"hidden {tuple(hidden.shape)}")


def check_linear_cross_entropy(hidden, weight, bias, target, reduction, chunk_rows):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    check_lm_head("linear_cross_entropy", hidden, weight, bias, target)
    _check(hidden.dtype == weight.dtype, lambda: f"linear_cross_entropy: hidden {hidden.dtype} and weight "
                                                 f"{weight.dtype} must have one dtype, as F.linear needs")
    _check(reduction in LOSS_REDUCTIONS,
           lambda: f"linear_cross_entropy: reduction {reduction!r} is not one of {LOSS_REDUCTIONS}")
    _check(chunk_rows > 0, lambda: f"linear_cross_entropy: chunk_rows={chunk_rows} must be positive")


def _linear_ce_setup_context(ctx, inputs, output):
    _, d_hidden, d_weight = output
    ctx.mark_non_differentiable(d_hidden, d_weight)
    ctx.save_for_backward(d_hidden, d_weight)
    ctx.computed = inputs[-2:]  # (grad_hidden, grad_weight)


def _linear_ce_grad(ctx, grad_loss, _d_hidden, _d_weight):
    wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    if any(need and not computed for need, computed in zip(wanted, ctx.computed)) or ctx.needs_input_grad[2]:
        raise RuntimeError("graphopt::linear_cross_entropy was built without the gradient now asked for (the fusion "
                           "pass decides from requires_grad at compile time; the bias never trains): recompile "
                           "after changing which of hidden states, lm_head weight or bias require grad")
    d_hidden, d_weight = torch.ops.graphopt.linear_cross_entropy_backward(grad_loss, *ctx.saved_tensors)
    return (d_hidden if wanted[0] else None, d_weight if wanted[1] else None) + (None,) * 8


linear_cross_entropy.register_autograd(_linear_ce_grad, setup_context=_linear_ce_setup_context)


# --- linear_logprobs (TRL's chunked log-prob head: per-token log-probs and statistics, logits never whole) --------

@torch.library.custom_op("graphopt::linear_logprobs", mutates_args=())
def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, temperature: float,
                    softcap: float, logit_scale: float, compute_dtype: torch.dtype, entropy: bool,
                    log_sum_sq_probs: bool, mean_logits: bool, is_top1: bool,
                    chunk_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, log_z) per row of hidden, of the next-token
    distribution softmax(((hidden·Wᵀ + b)·logit_scale, softcapped) / temperature), computed chunk_rows rows at a
    time in compute_dtype (statistics in fp32); an output not asked for is an empty tensor. kernels/reference.py
    states the exact semantics."""
    check_linear_logprobs(hidden, weight, bias, targets, temperature, softcap, compute_dtype, chunk_rows)
    return reference.linear_logprobs(hidden, weight, bias, targets, temperature, softcap, logit_scale, compute_dtype,
                                     entropy, log_sum_sq_probs, mean_logits, is_top1, chunk_rows)


@linear_logprobs.register_fake
def _linear_logprobs_fake(hidden, weight, bias, targets, temperature, softcap, logit_scale, compute_dtype, entropy,
                          log_sum_sq_probs, mean_logits, is_top1, chunk_rows):
    check_linear_logprobs(hidden, weight, bias, targets, temperature, softcap, compute_dtype, chunk_rows)
    rows, stats = hidden.shape[0], torch.promote_types(compute_dtype, torch.float32)

    def per_row(asked, dtype=stats):
        return hidden.new_empty(rows if asked else 0, dtype=dtype)

    return (per_row(True), per_row(entropy), per_row(log_sum_sq_probs), per_row(mean_logits),
            per_row(is_top1, torch.bool), per_row(True))


@torch.library.custom_op("graphopt::linear_logprobs_backward", mutates_args=())
def linear_logprobs_backward(grad_log_probs: Tensor, grad_entropy: Tensor, hidden: Tensor, weight: Tensor,
                             bias: Optional[Tensor], targets: Tensor, log_z: Tensor, entropy: Tensor,
                             temperature: float, softcap: float, logit_scale: float, compute_dtype: torch.dtype,
                             chunk_rows: int, grad_hidden: bool, grad_weight: bool) -> tuple[Tensor, Tensor]:
    """(d hidden, d weight) from the gradients of log_probs and entropy (grad_entropy empty: no entropy term); the
    logits are recomputed chunk by chunk; a gradient not asked for is an empty tensor."""
    check_linear_logprobs(hidden, weight, bias, targets, temperature, softcap, compute_dtype, chunk_rows)
    d_hidden, d_weight = reference.linear_logprobs_backward(
        grad_log_probs, grad_entropy, hidden, weight, bias, targets, log_z, entropy, temperature, softcap,
        logit_scale, compute_dtype, chunk_rows, grad_hidden, grad_weight)
    return d_hidden.contiguous(), d_weight.contiguous()


@linear_logprobs_backward.register_fake
def _linear_logprobs_backward_fake(grad_log_probs, grad_entropy, hidden, weight, bias, targets, log_z, entropy,
                                   temperature, softcap, logit_scale, compute_dtype, chunk_rows, grad_hidden,
                                   grad_weight):
    check_linear_logprobs(hidden, weight, bias, targets, temperature, softcap, compute_dtype, chunk_rows)
    return (hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else weight.new_empty(0))


def check_linear_logprobs(hidden, weight, bias, targets, temperature, softcap, compute_dtype, chunk_rows):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    check_lm_head("linear_logprobs", hidden, weight, bias, targets)
    _check(compute_dtype.is_floating_point,
           lambda: f"linear_logprobs: compute_dtype {compute_dtype} is not a float dtype")
    _check(temperature > 0 and softcap >= 0,
           lambda: f"linear_logprobs: temperature={temperature} must be > 0 and softcap={softcap} >= 0")
    _check(chunk_rows > 0, lambda: f"linear_logprobs: chunk_rows={chunk_rows} must be positive")


def _linear_logprobs_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, softcap, logit_scale, compute_dtype, *_, chunk_rows = inputs
    _, entropy, log_sum_sq_probs, mean_logits, _, log_z = output
    ctx.mark_non_differentiable(log_sum_sq_probs, mean_logits, log_z)
    ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
    ctx.settings = (temperature, softcap, logit_scale, compute_dtype, chunk_rows)


def _linear_logprobs_grad(ctx, grad_log_probs, grad_entropy, *_):
    if ctx.needs_input_grad[2]:
        raise RuntimeError("graphopt::linear_logprobs computes no gradient for the lm_head bias: it must be frozen "
                           "(requires_grad=False); the fusion pass never fuses otherwise")
    hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
    wanted = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    d_hidden, d_weight = torch.ops.graphopt.linear_logprobs_backward(
        grad_log_probs, grad_entropy, hidden, weight, bias, targets, log_z, entropy, *ctx.settings, *wanted)
    return (d_hidden if wanted[0] else None, d_weight if wanted[1] else None) + (None,) * 11


linear_logprobs.register_autograd(_linear_logprobs_grad, setup_context=_linear_logprobs_setup_context)


# --- padded_attention ---------------------------------------------------------------------------------------

@torch.library.custom_op("graphopt::padded_attention", mutates_args=())
def padded_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float,
                     window: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(out, lse): causal attention of each row's kept tokens (keep [B, L] bool), 0 at padding queries, each query
    within its `window` latest positions where given (a sliding window); GQA when k and v have fewer heads. The
    definition and layouts: kernels/reference.py."""
    check_padded_attention(q, k, v, keep, window)
    return reference.padded_attention(q, k, v, keep, scale, window)


def _attention_layout(x):
    """An empty tensor of x's shape, laid out as padded_attention's outputs: [B, H, L, D] stored [B, L, H, D]."""
    batch, heads, length, dim = x.shape
    return x.new_empty((batch, length, heads, dim)).transpose(1, 2)


def _attention_outputs(q):
    """(out, lse) as padded_attention and packed_attention return them, empty."""
    batch, heads, length, _ = q.shape
    return _attention_layout(q), q.new_empty((heads, batch * length), dtype=torch.float32)


@padded_attention.register_fake
def _padded_attention_fake(q, k, v, keep, scale, window=None):
    check_padded_attention(q, k, v, keep, window)
    return _attention_outputs(q)


@torch.library.custom_op("graphopt::padded_attention_backward", mutates_args=())
def padded_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Tensor, out: Tensor,
                              lse: Tensor, scale: float, window: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's out and lse."""
    check_padded_attention(q, k, v, keep, window)
    return reference.padded_attention_backward(grad_out, q, k, v, keep, out, lse, scale, window)


@padded_attention_backward.register_fake
def _padded_attention_backward_fake(grad_out, q, k, v, keep, out, lse, scale, window=None):
    check_padded_attention(q, k, v, keep, window)
    return _attention_layout(q), _attention_layout(k), _attention_layout(v)


def _check_attention(op, q, k, v):
    _check(q.dim() == 4 and k.dim() == 4 and k.shape == v.shape,
           lambda: f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                   f"[batch, heads, length, head_dim], k and v of one shape")
    _check(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2] and k.shape[3] == q.shape[3]
           and q.shape[1] % k.shape[1] == 0,
           lambda: f"{op}: k and v {tuple(k.shape)} must match q {tuple(q.shape)} but in heads, a divisor of q's")


def _check_window(op, window):
    _check(window is None or window >= 1, lambda: f"{op}: a sliding window of {window} positions must hold one")


def check_padded_attention(q, k, v, keep, window=None):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    _check_attention("padded_attention", q, k, v)
    _check_window("padded_attention", window)
    _check(keep.dtype == torch.bool and keep.dim() == 2 and keep.shape[0] == q.shape[0]
           and keep.shape[1] == q.shape[2],
           lambda: f"padded_attention: keep {tuple(keep.shape)} {keep.dtype} must be bool [batch, length]")


def _masked_attention_setup_context(ctx, inputs, output):
    q, k, v, tokens, scale, window = inputs  # tokens: padded_attention's keep, packed_attention's position_ids
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, tokens, out, lse)
    ctx.scale, ctx.window = scale, window


def _padded_attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, keep, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.graphopt.padded_attention_backward(grad_out, q, k, v, keep, out, lse, ctx.scale,
                                                              ctx.window)
    return dq, dk, dv, None, None, None


padded_attention.register_autograd(_padded_attention_grad, setup_context=_masked_attention_setup_context)


# --- packed_attention ---------------------------------------------------------------------------------------

# Tagged cudagraph_unsafe: the CUDA kernels count the documents on the host, which a CUDA graph cannot replay, so
# under CUDA graphs the op runs between the captured parts (Inductor's graph_partition).
@torch.library.custom_op("graphopt::packed_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def packed_attention(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, scale: float,
                     window: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(out, lse): causal attention within each document of a packed batch, the documents found from position_ids
    [B, L] (one starts wherever a position is not the one before it plus 1), each query within its `window` latest
    positions where given (a sliding window); GQA when k and v have fewer heads. The definition and layouts:
    kernels/reference.py."""
    check_packed_attention(q, k, v, position_ids, window)
    return reference.packed_attention(q, k, v, position_ids, scale, window)


@packed_attention.register_fake
def _packed_attention_fake(q, k, v, position_ids, scale, window=None):
    check_packed_attention(q, k, v, position_ids, window)
    return _attention_outputs(q)


@torch.library.custom_op("graphopt::packed_attention_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def packed_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, out: Tensor,
                              lse: Tensor, scale: float, window: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's out and lse."""
    check_packed_attention(q, k, v, position_ids, window)
    return reference.packed_attention_backward(grad_out, q, k, v, position_ids, out, lse, scale, window)


@packed_attention_backward.register_fake
def _packed_attention_backward_fake(grad_out, q, k, v, position_ids, out, lse, scale, window=None):
    check_packed_attention(q, k, v, position_ids, window)
    return _attention_layout(q), _attention_layout(k), _attention_layout(v)


def check_packed_attention(q, k, v, position_ids, window=None):
    """The op's input contract; every implementation (reference, fake, target kernels) checks it."""
    _check_attention("packed_attention", q, k, v)
    _check_window("packed_attention", window)
    _check(not position_ids.is_floating_point() and position_ids.dtype != torch.bool
           and position_ids.dim() == 2 and position_ids.shape[0] == q.shape[0]
           and position_ids.shape[1] == q.shape[2],
           lambda: f"packed_attention: position_ids {tuple(position_ids.shape)} {position_ids.dtype} must be "
                   f"integers [batch, length]")


def _packed_attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, position_ids, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.graphopt.packed_attention_backward(grad_out, q, k, v, position_ids, out, lse, ctx.scale,
                                                              ctx.window)
    return dq, dk, dv, None, None, None


packed_attention.register_autograd(_packed_attention_grad, setup_context=_masked_attention_setup_context)


# --- offload / reload: saved activations to host memory and back (inserted by passes/offload.py) -----------

# Captured in CUDA graphs with the rest of the step: no host tensor crosses the graph's boundary (a token stands
# for each host copy), and the host buffers are pinned before any capture (lowering/transfer.py).
@torch.library.custom_op("graphopt::offload", mutates_args=())
def offload(x: Tensor, after: list[Tensor], keep: list[Tensor], wait: bool) -> Tensor:
    """Starts copying x to host memory (pinned, on a side stream: lowering/transfer.py) and returns its token, a
    one-byte tensor on x's device that reload takes back. First makes the compute stream wait for the copies of
    the earlier offloads whose tokens are `after` (their tensors are `keep`, alive until then); with `wait`, for
    this copy too."""
    return transfer.offload(x, after, keep, wait)


@offload.register_fake
def _offload_fake(x, after, keep, wait):
    return torch.empty(1, dtype=torch.uint8, device=x.device)


@torch.library.custom_op("graphopt::reload", mutates_args=())
def reload(token: Tensor, shape: list[int], dtype: torch.dtype, device: torch.device,
           prefetch: list[Tensor]) -> Tensor:
    """The tensor offloaded under `token`, back on device (of that shape and dtype), once the compute stream may
    read it; then starts copying back the tensors of the tokens in `prefetch` (those the backward reloads next)
    so they are there before they are needed."""
    return transfer.reload(token, device, prefetch)


@reload.register_fake
def _reload_fake(token, shape, dtype, device, prefetch):
    return torch.empty(shape, dtype=dtype, device=device)


# --- copy_out_of_graph_pool: graph outputs that outlive a step, under CUDA graphs (passes/graph_pool.py) -----

# cudagraph_unsafe: it runs between the captured partitions, so that its copies are ordinary allocations, not the
# graphs' pool, which the next replay writes over.
@torch.library.custom_op("graphopt::copy_out_of_graph_pool", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def copy_out_of_graph_pool(xs: list[Tensor]) -> list[Tensor]:
    """A copy of each tensor, in as few launches as torch's multi-tensor kernels take (×1 is exact: -0.0, inf and
    NaN stay as they are)."""
    return list(torch._foreach_mul(xs, 1.0)) if xs else []


@copy_out_of_graph_pool.register_fake
def _copy_out_of_graph_pool_fake(xs):
    return [torch.empty_like(x) for x in xs]


# --- autocast: the ops compute what eager computes under torch.autocast ---------------------------------------

# A custom op is opaque to torch.autocast: without a rule it sees its inputs as they come, so a LoRA linear of an
# fp32 base under bf16 autocast would meet a bf16 input and an fp32 weight. Eager runs PEFT's linears (base and
# adapters: x.to(adapter dtype) is cast back down by autocast's linear) and HF's lm_head in the autocast dtype, so
# these ops take those inputs cast to it, as autocast's own linear would, and the gradients flow back through the
# casts to the fp32 parameters as eager's do. lora_linear_4bit: bitsandbytes computes the base in its compute dtype
# whatever autocast says (the pass fuses only where that is the autocast dtype), the adapters run in the autocast
# dtype; x, the bias and the adapters are cast, and the base is added in x's own dtype, as PEFT adds it.
# padded_attention and packed_attention stand for an SDPA call, which
# autocast runs in its dtype: q, k and v are cast too. The other ops need no rule: RMSNorm upcasts to fp32 itself,
# and the gated activation and RoPE contain no op that autocast changes (a rotation that eager promotes to fp32 is
# cast up by passes/fuse_rope.py). The dtype is read at each call, so bf16 and fp16 autocast both hold, on every
# device type that has autocast. linear_logprobs needs none either: it takes the dtype TRL's head computes in as an
# argument (compute_dtype, the autocast dtype of the call's region, passes/fuse_trl_logprob.py), so its gradients
# accumulate in fp32 and return in the inputs' own dtypes, as TRL's do, instead of rounding through a cast.
AUTOCAST_CASTS = {  # op → the positions of the inputs autocast casts
    "lora_down": (0, 1),  # x, lora_a
    "lora_linear": (0, 1, 2, 3, 4, 5),  # x, weight, bias, lora_a, lora_b, xa (lora_down's: already cast)
    "lora_linear_4bit": (0, 6, 10, 11, 12),  # x, bias, lora_a, lora_b, xa: the base dequantizes in x's dtype
    "linear_cross_entropy": (0, 1, 2),  # hidden, weight, bias
    "padded_attention": (0, 1, 2),  # q, k, v: autocast runs SDPA in its dtype
    "packed_attention": (0, 1, 2),
}
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "privateuseone")  # privateuseone: Ascend's npu


def _autocast_kernel(op, dispatch_key, positions):
    excluded = torch._C.DispatchKeySet(dispatch_key)

    def kernel(_keyset, *args):
        device_type = next(a.device.type for a in args if isinstance(a, Tensor))
        dtype = torch.get_autocast_dtype(device_type)

        def cast(i, a):
            eligible = (i in positions and isinstance(a, Tensor) and a.is_floating_point()
                        and a.dtype != torch.float64 and a.device.type == device_type)
            return a.to(dtype) if eligible else a

        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*(cast(i, a) for i, a in enumerate(args)))

    return kernel


_AUTOCAST_LIBRARY = torch.library.Library("graphopt", "IMPL")
for _name, _positions in AUTOCAST_CASTS.items():
    for _device in filter(torch.amp.is_autocast_available, _AUTOCAST_DEVICES):
        _key = "Autocast" + torch._C._dispatch_key_for_device(_device)
        _AUTOCAST_LIBRARY.impl(_name, _autocast_kernel(getattr(torch.ops.graphopt, _name).default,
                                                       getattr(torch._C.DispatchKey, _key), _positions),
                               _key, with_keyset=True)


# Forward op → its backward op, for the report and the lowerings (None: no gradient flows through it).
BACKWARD_OF = {
    torch.ops.graphopt.rms_norm.default: torch.ops.graphopt.rms_norm_backward.default,
    torch.ops.graphopt.gated_activation.default: torch.ops.graphopt.gated_activation_backward.default,
    torch.ops.graphopt.rope.default: torch.ops.graphopt.rope_backward.default,
    torch.ops.graphopt.lora_down.default: None,  # lora_linear's backward differentiates through x·Aᵀ
    torch.ops.graphopt.lora_linear.default: torch.ops.graphopt.lora_linear_backward.default,
    torch.ops.graphopt.lora_linear_4bit.default: torch.ops.graphopt.lora_linear_4bit_backward.default,
    torch.ops.graphopt.linear_cross_entropy.default: torch.ops.graphopt.linear_cross_entropy_backward.default,
    torch.ops.graphopt.linear_logprobs.default: torch.ops.graphopt.linear_logprobs_backward.default,
    torch.ops.graphopt.padded_attention.default: torch.ops.graphopt.padded_attention_backward.default,
    torch.ops.graphopt.packed_attention.default: torch.ops.graphopt.packed_attention_backward.default,
}
ALL_OPS = [op for pair in BACKWARD_OF.items() for op in pair if op is not None]
