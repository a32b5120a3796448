"""SwiGLU / GeGLU Triton kernels: h = act(gate) * up and its backward; kernels/reference.py defines them.

fp32 math inside. The backward recomputes act(gate) from gate rather than reading a saved activation, and can write
its two gradients over gate and up (gated_activation_backward_in_place), as a caller that reads them no more
allows: two [tokens, MLP width] buffers fewer at the MLP backward.
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout
from graphopt.kernels.layout import as_rows

_SILU, _GELU_TANH = 0, 1
_KINDS = {"silu": _SILU, "gelu_tanh": _GELU_TANH}


@triton.jit
def _act_and_derivative(g, KIND: tl.constexpr):
    if KIND == 0:  # silu
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    else:  # tanh-approximate gelu, written with s = sigmoid(2u) = (1 + tanh(u)) / 2: no 1 + tanh cancellation
        k = 0.7978845608028654  # sqrt(2 / pi)
        s = tl.sigmoid(2.0 * k * (g + 0.044715 * g * g * g))
        return g * s, s + 2.0 * g * s * (1.0 - s) * k * (1.0 + 3.0 * 0.044715 * g * g)


@triton.jit
def _offsets(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows[:, None], cols[None, :], mask


@triton.jit(do_not_specialize=["n_rows"])  # token-count sizes: kernels/layout.py
def _gated_forward_kernel(G, U, H, n_rows, n_cols, stride_g, stride_u, stride_h,
                          KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _offsets(n_rows, n_cols, BLOCK_M, BLOCK_N)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_derivative(g, KIND)
    tl.store(H + rows * stride_h + cols, (act * u).to(H.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])  # token-count sizes: kernels/layout.py
def _gated_backward_kernel(DH, G, U, DG, DU, n_rows, n_cols, stride_dh, stride_g, stride_u, stride_dg, stride_du,
                           KIND: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    rows, cols, mask = _offsets(n_rows, n_cols, BLOCK_M, BLOCK_N)
    dh = tl.load(DH + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_derivative(g, KIND)
    if IN_PLACE:  # through G's and U's own pointers, which this program has read at the same elements
        tl.store(G + rows * stride_g + cols, (dh * u * dact).to(G.dtype.element_ty), mask=mask)
        tl.store(U + rows * stride_u + cols, (dh * act).to(U.dtype.element_ty), mask=mask)
    else:
        tl.store(DG + rows * stride_dg + cols, (dh * u * dact).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + rows * stride_du + cols, (dh * act).to(DU.dtype.element_ty), mask=mask)


def _grid(n_rows, n_cols, like):
    """Block sizes from the columns alone, so that a launch traced over a symbolic row count (lowering/traced.py)
    branches on no size of it."""
    block_n = min(layout.next_power_of_2(max(n_cols, 1)), 1024)
    elements = 65536 if layout.platform(like) == "cpu" else 4096  # the interpreter wants few, large programs
    block_m = max(1, elements // block_n)
    return block_m, block_n, (layout.cdiv(n_rows, block_m), layout.cdiv(n_cols, block_n))


def gated_activation_forward(gate, up, activation):
    n_cols = gate.shape[-1]
    g, u = as_rows(gate, n_cols), as_rows(up, n_cols)
    h = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if h.numel():
        block_m, block_n, grid = _grid(g.shape[0], n_cols, gate)
        _gated_forward_kernel[grid](g, u, h, g.shape[0], n_cols, g.stride(0), u.stride(0), h.stride(0),
                                    KIND=_KINDS[activation], BLOCK_M=block_m, BLOCK_N=block_n,
                                    num_warps=layout.num_warps(gate, 4))
    return h.view(gate.shape)


def gated_activation_backward(grad_out, gate, up, activation):
    n_cols = gate.shape[-1]
    dh, g, u = as_rows(grad_out, n_cols), as_rows(gate, n_cols), as_rows(up, n_cols)
    dg = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(u.shape, dtype=up.dtype, device=up.device)
    if dg.numel():
        _launch_backward(dh, g, u, dg, du, activation, in_place=False)
    return dg.view(gate.shape), du.view(up.shape)


def gated_activation_backward_in_place(grad_out, gate, up, activation):
    """gated_activation_backward with the gate's gradient written over gate and the up projection's over up, which
    it returns; for a caller that reads gate and up no more (lowering/traced.py traces it where the backward
    graph's call is their last reader). gate and up are taken whole, not through views, which a trace would record
    as writes through a view: contiguous ones of two dims or more only (else into new tensors, as
    gated_activation_backward)."""
    if not (gate.dim() >= 2 and gate.is_contiguous() and up.is_contiguous()):
        return gated_activation_backward(grad_out, gate, up, activation)
    n_cols = gate.shape[-1]
    if gate.numel():
        _launch_backward(as_rows(grad_out, n_cols), gate, up, gate, up, activation, in_place=True)
    return gate, up


def _launch_backward(dh, g, u, dg, du, activation, in_place):
    """The backward kernel over dh's rows (a [rows, width] matrix); g, u, dg, du of the same rows, each with unit
    column stride and one row stride (its stride(-2): rows views, or whole contiguous tensors)."""
    n_rows, n_cols = dh.shape
    block_m, block_n, grid = _grid(n_rows, n_cols, g)
    layout.launcher(_gated_backward_kernel)[grid](
        dh, g, u, dg, du, n_rows, n_cols, dh.stride(0), g.stride(-2), u.stride(-2), dg.stride(-2), du.stride(-2),
        KIND=_KINDS[activation], IN_PLACE=in_place, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=layout.num_warps(g, 4))
