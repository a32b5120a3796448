"""Linear + cross-entropy on the GPU: cuBLAS for the lm_head matmuls, one Triton kernel per chunk of rows for the
loss and its gradient. kernels/reference.py defines what they compute.

The kernel reads a chunk's logits (in the hidden dtype, as the lm_head matmul wrote them) twice — an online
max/sum-exp pass, then a pass that writes the gradient over them in place — so a chunk costs its logits and
nothing else: no fp32 copy, no separate softmax. fp32 math inside.
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout


@triton.jit
def _tanh(y):
    # tanh from exp (libdevice does not run in Triton's interpreter): exact to ~1e-7 absolute
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _cross_entropy_chunk_kernel(
    LOGITS, TARGET, LOSS, SCALE, n_cols, stride_row, ignore_index, softcap,
    HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_row
    target = tl.load(TARGET + row)
    valid = target != ignore_index

    # pass 1: log-sum-exp of the (softcapped) row, online over column blocks
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(logits + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        z = tl.where(mask, z, -float("inf"))
        block_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - block_max) + tl.sum(tl.exp(z - block_max), axis=0)
        running_max = block_max
    lse = running_max + tl.log(running_sum)

    z_target = tl.load(logits + target, mask=valid, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z_target = softcap * _tanh(z_target / softcap)
    tl.store(LOSS + row, tl.where(valid, lse - z_target, 0.0))

    # pass 2: d loss/d logits = (softmax − onehot) · scale, written over the logits; ignored rows get zeros
    if COMPUTE_GRAD:
        scale = tl.where(valid, tl.load(SCALE), 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(logits + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                capped = _tanh(z / softcap)
                z = softcap * capped
            grad = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            if HAS_SOFTCAP:
                grad = grad * (1.0 - capped * capped)
            tl.store(logits + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows,
                         grad_hidden, grad_weight):
    """Same contract as kernels/reference.py's linear_cross_entropy, on CUDA tensors."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    valid = target != ignore_index
    count = valid.sum()
    # eager raises on an out-of-range label; this checks it without a host synchronisation
    torch._assert_async(((target >= 0) & (target < vocab) | ~valid).all(),
                        "linear_cross_entropy: a label is outside [0, vocab) and is not ignore_index")
    scale = (1 / count.clamp_min(1).float() if reduction == "mean" else torch.ones((), device=hidden.device))
    scale = scale.reshape(1)
    row_losses = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
    compute_grad = grad_hidden or grad_weight
    block = min(4096, layout.next_power_of_2(vocab))
    num_warps = layout.num_warps(hidden, 16 if block >= 2048 else 4)
    for start in range(0, n_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n_rows))
        h = hidden[rows]
        logits = torch.nn.functional.linear(h, weight, bias)  # becomes the gradient in place
        _cross_entropy_chunk_kernel[(h.shape[0],)](
            logits, target[rows], row_losses[rows], scale, vocab, logits.stride(0), ignore_index, softcap,
            HAS_SOFTCAP=softcap > 0, COMPUTE_GRAD=compute_grad, BLOCK=block, num_warps=num_warps,
        )
        if grad_hidden:
            torch.mm(logits, weight, out=d_hidden[rows])
        if grad_weight:
            d_weight += (logits.t() @ h).float()
    loss = row_losses.sum()
    loss = loss / count if reduction == "mean" else loss
    return loss, d_hidden, d_weight.to(weight.dtype) if grad_weight else weight.new_empty(0)
