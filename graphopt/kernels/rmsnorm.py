"""RMSNorm Triton kernels and their launch functions; kernels/reference.py defines what they must compute.

All math is fp32 inside, rounded once to the output dtype. The backward recomputes rstd from x (x is read
anyway), so only x and the weight are saved for it.
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout
from graphopt.kernels.layout import as_rows

# One program holds a whole row in registers; wider rows use the reference (no LLM is near this).
MAX_HIDDEN = 65536


@triton.jit(do_not_specialize=["n_rows"])  # token-count sizes: kernels/layout.py
def _rms_norm_forward_kernel(
    X, W, Y, n_rows, n_cols, stride_x, stride_y, eps, weight_offset,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + weight_offset
        y = y * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])  # token-count sizes: kernels/layout.py
def _rms_norm_backward_kernel(
    DY, X, W, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
    stride_dy, stride_x, stride_dx, eps, weight_offset,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Each program walks its own band of rows, so dW is reduced in registers and written once per program.
    pid = tl.program_id(0)
    first_row = pid.to(tl.int64) * rows_per_program
    end_row = tl.minimum(first_row + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(first_row, end_row, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        rstd = tl.where(row_mask, rstd, 0.0)  # padding rows must add nothing to dW, even with eps == 0
        x_hat = x * rstd[:, None]
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        c = tl.sum(g * x_hat, axis=1) / n_cols
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=col_mask)


def _tile(n_rows: int, n_cols: int, like: torch.Tensor):
    """Block shape and warps (as tuned on NVIDIA: layout.num_warps). On CPU (the Triton interpreter) big tiles keep
    the program count low."""
    block_n = layout.next_power_of_2(n_cols)
    elements = 65536 if layout.platform(like) == "cpu" else 4096
    block_m = max(1, min(elements // block_n, layout.next_power_of_2(max(n_rows, 1))))
    tile = block_m * block_n
    num_warps = layout.num_warps(like, 4 if tile <= 2048 else 8 if tile <= 8192 else 16)
    return block_m, block_n, num_warps


def _check_hidden(n_cols: int):
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"rms_norm Triton kernel holds one row in registers: hidden size {n_cols} > {MAX_HIDDEN}; "
                         "use kernels.reference.rms_norm")


def rms_norm_forward(x, weight, eps, weight_offset, out_dtype):
    n_cols = x.shape[-1]
    _check_hidden(n_cols)
    x2 = as_rows(x, n_cols)
    weight = weight.contiguous() if weight is not None else None
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    if n_rows > 0:
        block_m, block_n, num_warps = _tile(n_rows, n_cols, x)
        _rms_norm_forward_kernel[(layout.cdiv(n_rows, block_m),)](
            x2, weight if weight is not None else x2, y, n_rows, n_cols, x2.stride(0), y.stride(0),
            eps, weight_offset, HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y.view(x.shape)


def rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad):
    n_cols = x.shape[-1]
    _check_hidden(n_cols)
    x2 = as_rows(x, n_cols)
    dy = as_rows(grad_out, n_cols)
    weight = weight.contiguous() if weight is not None else None
    n_rows = x2.shape[0]
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block_m, block_n, num_warps = _tile(n_rows, n_cols, x)
    programs = 4 if layout.platform(x) == "cpu" else 2 * layout.multiprocessors(x.device)
    rows_per_program = layout.cdiv(layout.cdiv(max(n_rows, 1), programs), block_m) * block_m
    programs = layout.cdiv(max(n_rows, 1), rows_per_program)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device) if compute_weight_grad else dx
    if n_rows > 0:
        _rms_norm_backward_kernel[(programs,)](
            dy, x2, weight if weight is not None else x2, dx, dw_partial, n_rows, n_cols, rows_per_program,
            dy.stride(0), x2.stride(0), dx.stride(0), eps, weight_offset,
            HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_weight_grad, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    if not compute_weight_grad:
        grad_w = x.new_empty(0)
    elif n_rows == 0:
        grad_w = torch.zeros_like(weight)
    else:
        grad_w = dw_partial.sum(0).to(weight.dtype)
    return dx.view(x.shape), grad_w
