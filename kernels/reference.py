"""Pure-torch references of every graphopt op: the definition of correct (fp32 math; fp64 for fp64 inputs).

Kept free of Triton so every device, and every test, can run them.

RMSNorm:  y = x * rsqrt(mean(x², last dim) + eps) * (weight + weight_offset), rounded once to out_dtype.
`weight_offset` is 0 for Llama-style norms and 1 for Gemma's `(1 + weight)`.
"""

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x, weight, eps, weight_offset, out_dtype):
    xf = x.to(_compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(xf.dtype) + weight_offset)
    return y.to(out_dtype)


def rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad):
    xf = x.to(_compute_dtype(x))
    dy = grad_out.to(xf.dtype)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * rstd
    g = dy * (weight.to(xf.dtype) + weight_offset) if weight is not None else dy
    grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    if compute_weight_grad:
        grad_w = (dy * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    else:
        grad_w = x.new_empty(0)
    return grad_x.to(x.dtype), grad_w


# Gated activations: h = act(gate) * up, act = silu (SwiGLU) or tanh-approximate gelu (GeGLU).
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def _activation(gate, activation):
    if activation == "silu":
        return torch.nn.functional.silu(gate)
    return torch.nn.functional.gelu(gate, approximate="tanh")


def gated_activation(gate, up, activation):
    dtype = _compute_dtype(gate)
    return (_activation(gate.to(dtype), activation) * up.to(dtype)).to(gate.dtype)


def gated_activation_backward(grad_out, gate, up, activation):
    dtype = _compute_dtype(gate)
    g, u, dh = gate.to(dtype), up.to(dtype), grad_out.to(dtype)
    if activation == "silu":
        s = torch.sigmoid(g)
        act, dact = g * s, s * (1 + g * (1 - s))
    else:  # with s = sigmoid(2u) = (1 + tanh(u)) / 2, which keeps the far negative tail accurate
        k = 0.7978845608028654  # sqrt(2 / pi)
        s = torch.sigmoid(2 * k * (g + 0.044715 * g.pow(3)))
        act = g * s
        dact = s + 2 * g * s * (1 - s) * k * (1 + 3 * 0.044715 * g * g)
    return (dh * u * dact).to(gate.dtype), (dh * act).to(up.dtype)


# LoRA linear (PEFT): out = (x·Wᵀ + b + ((x as adapter dtype)·Aᵀ)·Bᵀ · scaling) as out_dtype, the same operations
# in the same dtypes as PEFT's eager forward. Only A and B train; the base weight and bias are frozen.

def lora_linear(x, weight, bias, lora_a, lora_b, scaling, out_dtype):
    base = torch.nn.functional.linear(x, weight, bias)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(x.to(lora_a.dtype), lora_a), lora_b) * scaling
    return (base + lora).to(out_dtype)


def lora_linear_backward(grad_out, x, weight, lora_a, lora_b, scaling):
    """(grad_x, grad_a, grad_b). The adapter-dtype copy of x and x·Aᵀ are recomputed here, never saved."""
    base_dtype = torch.promote_types(x.dtype, weight.dtype)
    grad = grad_out.to(torch.promote_types(base_dtype, lora_b.dtype))
    grad_lora = (grad * scaling).to(lora_b.dtype).reshape(-1, lora_b.shape[0])
    x_adapter = x.to(lora_a.dtype).reshape(-1, x.shape[-1])
    xa = x_adapter @ lora_a.t()
    grad_b = grad_lora.t() @ xa
    grad_xa = grad_lora @ lora_b
    grad_a = grad_xa.t() @ x_adapter
    grad_x_lora = (grad_xa @ lora_a).to(x.dtype).reshape(x.shape)
    grad_x = (grad.to(base_dtype) @ weight).to(x.dtype) + grad_x_lora
    return grad_x, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype)
