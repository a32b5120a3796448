"""RoPE Triton kernel: q and k rotated in one launch, forward and backward; kernels/reference.py defines them.

fp32 math inside. Each program takes BLOCK_M rows (one row = one head at one position) of q or of k: the first
programs walk q's rows, the rest k's, so GQA's fewer k heads cost no idle programs. Inputs are read through their
own strides (HF's q and k are transposed views of [B, S, H, D]); outputs are contiguous [B, H, S, D]. The
backward is the same kernel with the transposed rotation: sin replaced by −(its halves swapped).
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout


@triton.jit
def _rotate_rows(X, Y, C, S, program, n_rows, n_heads, seq, stride_xb, stride_xh, stride_xs, stride_xd,
                 stride_cb, stride_cs, stride_cd, head_dim, rot_dim,
                 BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = program.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    b, h, s = rows // (n_heads * seq), (rows // seq) % n_heads, rows % seq
    x_row = (b * stride_xb + h * stride_xh + s * stride_xs)[:, None]
    c_row = (b * stride_cb + s * stride_cs)[:, None]
    y_row = rows[:, None] * head_dim
    half = rot_dim // 2
    cols = tl.arange(0, BLOCK_H)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < half)
    x1 = tl.load(X + x_row + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_row + (cols + half) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(C + c_row + cols * stride_cd, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(C + c_row + (cols + half) * stride_cd, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(S + c_row + cols * stride_cd, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(S + c_row + (cols + half) * stride_cd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # dx1 = g1·c1 + g2·s2, dx2 = g2·c2 − g1·s1
        s1, s2 = -s2, -s1
    tl.store(Y + y_row + cols, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + y_row + cols + half, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:  # partial rotary: channels rot_dim..head_dim are copied unchanged
        rest = rot_dim + tl.arange(0, BLOCK_P)[None, :]
        rest_mask = (rows < n_rows)[:, None] & (rest < head_dim)
        x = tl.load(X + x_row + rest * stride_xd, mask=rest_mask, other=0.0)
        tl.store(Y + y_row + rest, x.to(Y.dtype.element_ty), mask=rest_mask)


@triton.jit(do_not_specialize=["q_programs", "batch", "seq"])  # token-count sizes: kernels/layout.py
def _rope_kernel(Q, K, QO, KO, C, S, q_programs, batch, seq, q_heads, k_heads,
                 stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
                 stride_cb, stride_cs, stride_cd, head_dim, rot_dim,
                 BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    if pid < q_programs:
        _rotate_rows(Q, QO, C, S, pid, batch * q_heads * seq, q_heads, seq, stride_qb, stride_qh, stride_qs,
                     stride_qd, stride_cb, stride_cs, stride_cd, head_dim, rot_dim,
                     BACKWARD, BLOCK_M, BLOCK_H, BLOCK_P)
    else:
        _rotate_rows(K, KO, C, S, pid - q_programs, batch * k_heads * seq, k_heads, seq, stride_kb, stride_kh,
                     stride_ks, stride_kd, stride_cb, stride_cs, stride_cd, head_dim, rot_dim,
                     BACKWARD, BLOCK_M, BLOCK_H, BLOCK_P)


def _launch(q, k, cos, sin, backward):
    batch, q_heads, seq, head_dim = q.shape
    k_heads, rot_dim = k.shape[1], cos.shape[-1]
    # A batch-1 cos/sin serves every batch row through a zero stride; sin is read with cos's strides.
    cos, sin = cos.expand(batch, seq, rot_dim), sin.expand(batch, seq, rot_dim)
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k))
    block_h = layout.next_power_of_2(rot_dim // 2)
    block_p = layout.next_power_of_2(head_dim - rot_dim) if head_dim > rot_dim else 0
    q_rows, k_rows = q.numel() // head_dim, k.numel() // head_dim
    elements = 65536 if layout.platform(q) == "cpu" else 4096  # the interpreter wants few, large programs
    row_elements = layout.next_power_of_2(2 * block_h + block_p)
    block_m = elements // row_elements
    if isinstance(q_rows, int):  # a symbolic row count (a traced launch's) may not be branched on
        block_m = max(1, min(block_m, layout.next_power_of_2(max(q_rows, k_rows, 1))))
    q_programs = layout.cdiv(q_rows, block_m)
    programs = q_programs + layout.cdiv(k_rows, block_m)
    if not layout.known_zero(programs):
        layout.launcher(_rope_kernel)[(programs,)](
            q, k, q_out, k_out, cos, sin, q_programs, batch, seq, q_heads, k_heads, *q.stride(), *k.stride(),
            *cos.stride(), head_dim, rot_dim, BACKWARD=backward, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_P=block_p,
            num_warps=layout.num_warps(q, 4))
    return q_out, k_out


def rope_forward(q, k, cos, sin):
    return _launch(q, k, cos, sin, backward=False)


def rope_backward(grad_q, grad_k, cos, sin):
    return _launch(grad_q, grad_k, cos, sin, backward=True)
