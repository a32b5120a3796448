"""graphopt::padded_attention on NVIDIA GPUs: FlashAttention-2's variable-length kernels (aten's
_flash_attention_forward/_backward), which skip what the mask excludes instead of computing it and masking.

Each row's kept tokens are gathered to its front, in order (a stable sort of the padding flags), and the batch is
handed to the kernels as 2·B causal sequences of one flat [B·L, H, D] layout: row b's kept tokens, then its padding.
The count is fixed (2·B), so nothing here waits for the GPU and a graph of symbolic length stays one graph. The
padding's own sequence computes something finite that the output then zeroes (the op's definition,
kernels/reference.py); its gradient is zeroed before the backward, so it contributes nothing.

The reordering is one Triton launch per tensor (_rows_kernel), a program per token moving all its heads, the
zeroing of the padding folded in: aten's advanced indexing takes an index kernel plus index and fill launches per
tensor, and reaches about a quarter of the H200's memory bandwidth (benchmarks/RESULTS.md, SFT section R).

A sliding window is the kernels' own (window_size_left), counted along each sequence: exact where a row's kept
tokens are one run (left or right padding, what tokenizers and HF's collators make). Where padding sits between
kept tokens the kernels count the window over kept tokens only, as HF's flash-attention path does, and the
definition (kernels/reference.py, over positions, as eager's mask) attends fewer keys.
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout

# What the kernels take; anything else runs the reference (kernels/reference.py).
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def unsupported(dtypes, head_dims, capability):
    """Why the kernels cannot take q, k, v of these dtypes and head dims on a GPU of this compute capability (None
    when they can; capability None: not checked)."""
    if dtypes[0] not in FLASH_DTYPES or len(set(dtypes)) > 1:
        return f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}: the flash kernels take 16-bit inputs"
    if head_dims[0] > MAX_HEAD_DIM or head_dims[0] % 8 or len(set(head_dims)) > 1:
        return f"head dim {head_dims[0]}: the flash kernels take up to {MAX_HEAD_DIM}, a multiple of 8"
    if capability is not None and capability < (8, 0):
        return f"compute capability {capability[0]}.{capability[1]}: the flash kernels need 8.0"
    return None


def supported(q, k, v) -> bool:
    return q.is_cuda and unsupported((q.dtype, k.dtype, v.dtype), (q.shape[-1], k.shape[-1], v.shape[-1]),
                                     torch.cuda.get_device_capability(q.device)) is None


@layout.once_per_tensor
def _sequences(keep):
    """(each row's token order with its kept tokens first, cumulative sequence starts [2·B + 1] int32), once for
    the keep every layer's forward and backward read: about ten small launches, from the host, a call (64 calls
    a step at 8B, benchmarks/RESULTS.md, SFT AF)."""
    batch, length = keep.shape
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)
    kept = keep.sum(1, dtype=torch.int32)
    starts = torch.arange(batch, dtype=torch.int32, device=keep.device) * length
    bounds = torch.stack([starts, starts + kept], dim=1).flatten()
    return order, torch.cat([bounds, bounds.new_full((1,), batch * length)])


@triton.jit(do_not_specialize=["length"])
def _rows_kernel(
    PADDED, FLAT, ORDER, KEEP, length, heads, dim,
    stride_pb, stride_ph, stride_pl, stride_pd, stride_fr, stride_fh, stride_fd,
    TO_FLAT: tl.constexpr, MASKED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # flat row r = b·length + t holds the token at position ORDER[b, t] of row b of the padded layout
    row = tl.program_id(0).to(tl.int64)
    batch = row // length
    position = tl.load(ORDER + row)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    inside = (h < heads) & (d < dim)
    padded = PADDED + batch * stride_pb + position * stride_pl + h * stride_ph + d * stride_pd
    flat = FLAT + row * stride_fr + h * stride_fh + d * stride_fd
    x = tl.load(padded if TO_FLAT else flat, mask=inside, other=0.0)
    if MASKED:  # the padding's tokens as zeros
        x = tl.where(tl.load(KEEP + batch * length + position) != 0, x, tl.zeros_like(x))
    tl.store(flat if TO_FLAT else padded, x, mask=inside)


def _move_rows(padded, flat, order, keep, to_flat):
    """Between padded [B, H, L, D] (any strides) and flat [B·L, H, D] in `order`, either way; with keep [B, L]
    (contiguous), the padding's tokens written as zeros."""
    batch, heads, length, dim = padded.shape
    if batch * length == 0:
        return
    block_h, block_d = layout.next_power_of_2(heads), layout.next_power_of_2(dim)
    _rows_kernel[(batch * length,)](
        padded, flat, order, keep if keep is not None else order, length, heads, dim, *padded.stride(),
        *flat.stride(), TO_FLAT=to_flat, MASKED=keep is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=layout.num_warps(padded, 4 if block_h * block_d <= 4096 else 8))


def _flat(x, order, keep=None):
    """x [B, H, L, D] → [B·L, H, D], each row's tokens in `order`; with keep, the padding's tokens zero."""
    batch, heads, length, dim = x.shape
    out = torch.empty(batch * length, heads, dim, dtype=x.dtype, device=x.device)
    _move_rows(x, out, order, keep, to_flat=True)
    return out


def _unflat(y, order, keep, batch, length):
    """The inverse of _flat: [B·L, H, D] in `order` → [B, H, L, D] stored [B, L, H, D] (the op's output layout);
    with keep, the padding's tokens zero."""
    out = torch.empty(batch, length, *y.shape[1:], dtype=y.dtype, device=y.device).transpose(1, 2)
    _move_rows(out, y, order, keep, to_flat=False)
    return out


def longest_for_kernels(length):
    """The longest sequence, as the kernels are told it (it sizes their grid): at 1 the forward takes a decoding path
    that folds GQA's query heads into the sequence and assumes one query per sequence, which the padding's empty
    sequences break; 2 bounds it as well."""
    return max(length, 2)


def window_sizes(window):
    """The flash kernels' keyword arguments for a sliding window of `window` positions (None: none): the query
    attends window - 1 keys before it and itself."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def padded_attention_forward(q, k, v, keep, scale, window=None):
    batch, _, length, _ = q.shape
    order, bounds = _sequences(keep)
    keep = keep.contiguous()
    longest = longest_for_kernels(length)
    out, lse = torch.ops.aten._flash_attention_forward(
        _flat(q, order), _flat(k, order), _flat(v, order), bounds, bounds, longest, longest, 0.0, True, False,
        scale=scale, **window_sizes(window))[:2]
    return _unflat(out, order, keep, batch, length), lse


def padded_attention_backward(grad_out, q, k, v, keep, out, lse, scale, window=None):
    batch, _, length, _ = q.shape
    order, bounds = _sequences(keep)
    keep = keep.contiguous()
    longest = longest_for_kernels(length)
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the RNG state dropout would have used
    grads = torch.ops.aten._flash_attention_backward(
        _flat(grad_out, order, keep), _flat(q, order), _flat(k, order), _flat(v, order),
        _flat(out, order), lse, bounds, bounds, longest, longest, 0.0, True, no_dropout,
        torch.empty(0, device=q.device), scale=scale, **window_sizes(window))
    return tuple(_unflat(g, order, None, batch, length) for g in grads)
