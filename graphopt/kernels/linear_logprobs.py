"""Linear log-probabilities on the GPU (TRL's chunked log-prob head): cuBLAS for the lm_head matmuls, one Triton
kernel per chunk of rows for the per-token statistics (forward) and one for the logits' gradient (backward).
kernels/reference.py defines what they compute.

The forward kernel reads a chunk's logits (in compute_dtype, as the matmul wrote them) once: an online max/sum-exp
pass that carries beside the sum Σ e·z (entropy), Σ e² (log Σ p²), Σ z (mean logit) and the largest logit before
the target's column (is_top1), each rescaled as the running max moves. The backward recomputes the chunk's logits
and writes their gradient over them in place; cuBLAS reads it for dX and dW, both accumulated in fp32. A program
takes ROWS rows at once: one for large vocabularies, several for small ones (and the interpreter, which runs
about a thousand programs a second). fp32 math inside.
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout
from graphopt.kernels.cross_entropy import _tanh

MAX_BLOCK = 4096  # columns per step of a row's loop
ROW_ELEMENTS = 4096  # ROWS × BLOCK: rows share a program while their blocks together stay this small


@triton.jit
def _transform(y, logit_scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """(z, tanh(y·logit_scale / softcap)): TRL's order, scale, then softcap, then temperature. Without softcap the
    second value is unused."""
    z = y * logit_scale
    capped = z
    if HAS_SOFTCAP:
        capped = _tanh(z / softcap)
        z = softcap * capped
    return z * inv_temperature, capped


@triton.jit(do_not_specialize=["n_rows"])  # token-count sizes: kernels/layout.py
def _logprobs_forward_kernel(
    LOGITS, TARGETS, LOG_PROBS, ENTROPY, LOG_SUM_SQ, MEAN, TOP1, LOG_Z, n_rows, n_cols, stride_row,
    logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_LOG_SUM_SQ: tl.constexpr, HAS_MEAN: tl.constexpr,
    HAS_TOP1: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_in = rows < n_rows
    target = tl.load(TARGETS + rows, mask=row_in, other=0)
    logits = LOGITS + rows[:, None] * stride_row

    running_max = tl.full((ROWS,), -float("inf"), tl.float32)
    sum_exp = tl.zeros((ROWS,), tl.float32)  # Σ exp(z − running_max)
    sum_exp_z = tl.zeros((ROWS,), tl.float32)  # Σ exp(z − running_max)·z
    sum_exp_sq = tl.zeros((ROWS,), tl.float32)  # Σ exp(z − running_max)²
    sum_z = tl.zeros((ROWS,), tl.float32)
    max_before_target = tl.full((ROWS,), -float("inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        col_in = cols[None, :] < n_cols
        y = tl.load(logits + cols[None, :], mask=row_in[:, None] & col_in, other=0.0).to(tl.float32)
        z, _ = _transform(y, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        z = tl.where(col_in, z, 0.0)  # rows past n_rows read zeros: finite, and never stored
        if HAS_MEAN:
            sum_z += tl.sum(z, axis=1)
        if HAS_TOP1:  # the first maximum counts: an equal logit before the target's column makes it not top-1
            before = col_in & (cols[None, :] < target[:, None])
            max_before_target = tl.maximum(max_before_target, tl.max(tl.where(before, z, -float("inf")), axis=1))
        block_max = tl.maximum(running_max, tl.max(tl.where(col_in, z, -float("inf")), axis=1))
        rescale = tl.exp(running_max - block_max)
        e = tl.where(col_in, tl.exp(z - block_max[:, None]), 0.0)
        sum_exp = sum_exp * rescale + tl.sum(e, axis=1)
        if HAS_ENTROPY:
            sum_exp_z = sum_exp_z * rescale + tl.sum(e * z, axis=1)
        if HAS_LOG_SUM_SQ:
            sum_exp_sq = sum_exp_sq * rescale * rescale + tl.sum(e * e, axis=1)
        running_max = block_max

    log_z = running_max + tl.log(sum_exp)
    y_target = tl.load(LOGITS + rows * stride_row + target, mask=row_in, other=0.0).to(tl.float32)
    z_target, _ = _transform(y_target, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    tl.store(LOG_PROBS + rows, z_target - log_z, mask=row_in)
    tl.store(LOG_Z + rows, log_z, mask=row_in)
    if HAS_ENTROPY:
        tl.store(ENTROPY + rows, log_z - sum_exp_z / sum_exp, mask=row_in)
    if HAS_LOG_SUM_SQ:
        tl.store(LOG_SUM_SQ + rows, tl.log(sum_exp_sq) - 2 * tl.log(sum_exp), mask=row_in)
    if HAS_MEAN:
        tl.store(MEAN + rows, sum_z / n_cols, mask=row_in)
    if HAS_TOP1:
        tl.store(TOP1 + rows, (z_target >= running_max) & (z_target > max_before_target), mask=row_in)


@triton.jit(do_not_specialize=["n_rows"])  # token-count sizes: kernels/layout.py
def _logprobs_backward_kernel(
    LOGITS, TARGETS, LOG_Z, ENTROPY, GRAD_LOG_PROBS, GRAD_ENTROPY, n_rows, n_cols, stride_row,
    logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_in = rows < n_rows
    target = tl.load(TARGETS + rows, mask=row_in, other=0)
    log_z = tl.load(LOG_Z + rows, mask=row_in, other=0.0)
    grad_log_probs = tl.load(GRAD_LOG_PROBS + rows, mask=row_in, other=0.0).to(tl.float32)
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(ENTROPY + rows, mask=row_in, other=0.0)
        grad_entropy = tl.load(GRAD_ENTROPY + rows, mask=row_in, other=0.0).to(tl.float32)
    logits = LOGITS + rows[:, None] * stride_row
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_in[:, None] & (cols[None, :] < n_cols)
        y = tl.load(logits + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z, capped = _transform(y, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        log_p = z - log_z[:, None]
        p = tl.exp(log_p)
        # d log p[target] / dz = onehot − p;  d entropy / dz = −p·(log p + entropy)
        grad = grad_log_probs[:, None] * (tl.where(cols[None, :] == target[:, None], 1.0, 0.0) - p)
        if HAS_ENTROPY_GRAD:
            grad -= grad_entropy[:, None] * p * (log_p + entropy[:, None])
        grad = grad * inv_temperature
        if HAS_SOFTCAP:
            grad = grad * (1.0 - capped * capped)
        tl.store(logits + cols[None, :], (grad * logit_scale).to(LOGITS.dtype.element_ty), mask=mask)


def _launch_shape(vocab):
    """(rows per program, columns per step of a row's loop) for a vocabulary."""
    block = min(MAX_BLOCK, layout.next_power_of_2(vocab))
    return max(1, ROW_ELEMENTS // block), block


def _mm_fp32(a, b, out=None):
    """a @ b in fp32 (added into out when given), the product never rounded to a half dtype: cuBLAS writes fp32
    from bf16/fp16 operands on CUDA; elsewhere (the interpreter's tests) the operands are upcast."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    if out is None:
        return a.float() @ b.float()
    return out.addmm_(a.float(), b.float())


def _chunk_logits(h, weight, bias):
    logits = torch.mm(h, weight.t())
    if bias is not None:  # added to the rounded product, as TRL's tile is
        logits += bias
    return logits


def linear_logprobs(hidden, weight, bias, targets, temperature, softcap, logit_scale, compute_dtype, entropy,
                    log_sum_sq_probs, mean_logits, is_top1, chunk_rows):
    """Same contract as kernels/reference.py's linear_logprobs, on CUDA tensors."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    # an out-of-range target reads another row's logits: checked without a host synchronisation
    torch._assert_async(((targets >= 0) & (targets < vocab)).all(), "linear_logprobs: a target is outside [0, vocab)")
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)

    def per_row(asked, dtype=torch.float32):
        return torch.empty(n_rows if asked else 0, dtype=dtype, device=hidden.device)

    log_probs, log_z = per_row(True), per_row(True)
    outputs = (per_row(entropy), per_row(log_sum_sq_probs), per_row(mean_logits), per_row(is_top1, torch.bool))
    rows_per_program, block = _launch_shape(vocab)
    num_warps = layout.num_warps(hidden, 16 if block >= 2048 else 4)
    for start in range(0, n_rows, chunk_rows):
        part = slice(start, min(start + chunk_rows, n_rows))
        logits = _chunk_logits(hidden[part].to(compute_dtype), w, b)
        n = logits.shape[0]
        # an output not asked for is never written: its pointer is log_probs'
        ent, lss, mean, top1 = (out[part] if out.numel() else log_probs[part] for out in outputs)
        _logprobs_forward_kernel[(layout.cdiv(n, rows_per_program),)](
            logits, targets[part], log_probs[part], ent, lss, mean, top1, log_z[part], n, vocab, logits.stride(0),
            logit_scale, softcap, 1.0 / temperature,
            HAS_SOFTCAP=softcap > 0, HAS_ENTROPY=entropy, HAS_LOG_SUM_SQ=log_sum_sq_probs, HAS_MEAN=mean_logits,
            HAS_TOP1=is_top1, ROWS=rows_per_program, BLOCK=block, num_warps=num_warps,
        )
    return (log_probs, *outputs, log_z)


def linear_logprobs_backward(grad_log_probs, grad_entropy, hidden, weight, bias, targets, log_z, entropy,
                             temperature, softcap, logit_scale, compute_dtype, chunk_rows, grad_hidden, grad_weight):
    """Same contract as kernels/reference.py's linear_logprobs_backward, on CUDA tensors."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    d_hidden = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
    entropy_grad = grad_entropy.numel() > 0
    rows_per_program, block = _launch_shape(vocab)
    num_warps = layout.num_warps(hidden, 16 if block >= 2048 else 4)
    for start in range(0, n_rows, chunk_rows):
        part = slice(start, min(start + chunk_rows, n_rows))
        h = hidden[part].to(compute_dtype)
        logits = _chunk_logits(h, w, b)  # becomes its own gradient in place
        n = logits.shape[0]
        _logprobs_backward_kernel[(layout.cdiv(n, rows_per_program),)](
            logits, targets[part], log_z[part], entropy[part] if entropy_grad else log_z[part], grad_log_probs[part],
            grad_entropy[part] if entropy_grad else grad_log_probs[part], n, vocab, logits.stride(0),
            logit_scale, softcap, 1.0 / temperature,
            HAS_SOFTCAP=softcap > 0, HAS_ENTROPY_GRAD=entropy_grad, ROWS=rows_per_program, BLOCK=block,
            num_warps=num_warps,
        )
        if grad_hidden:
            d_hidden[part] = _mm_fp32(logits, w)
        if grad_weight:
            _mm_fp32(logits.t(), h, out=d_weight)
    return d_hidden, d_weight.to(weight.dtype) if grad_weight else weight.new_empty(0)
