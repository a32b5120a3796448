"""graphopt::padded_attention on NVIDIA GPUs: FlashAttention-2's variable-length kernels (aten's
_flash_attention_forward/_backward), which skip what the mask excludes instead of computing it and masking.

The batch's kept tokens are gathered to the front of one flat [B·L, H, D] layout, row after row, each row's in
order (a stable sort of the padding flags), and handed to the kernels as B causal sequences, one a row; the
padding's rows follow, which the kernels neither read nor write. The count is fixed (B), so nothing here waits for
the GPU and a graph of symbolic length stays one graph. The output and the gradients are zero at the padding (the
op's definition, kernels/reference.py). Computed, as a causal sequence of its own, a row's padding would cost the
kernels, in a batch of one long row and one short one, about as much as the long row (benchmarks/RESULTS.md, SFT
AI).

The reordering is one Triton launch per tensor (_rows_kernel), a program per token moving all its heads, the
padding's rows skipped one way and written as zeros the other: aten's advanced indexing takes an index kernel plus
index and fill launches per tensor, and reaches about a quarter of the H200's memory bandwidth
(benchmarks/RESULTS.md, SFT section R).

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
    """(the flat indices b·L + t of the batch's kept tokens, row after row, then of its padding [B·L]; cumulative
    sequence starts [B + 1] int32, one sequence a row over its kept tokens; [B·L] bool, true at the padding's
    rows in that order), once for the keep every layer's forward and backward read: a few small launches from
    the host, which would otherwise run in each of the 8B step's 64 calls (benchmarks/RESULTS.md, SFT AH). Under
    CUDA graphs, whose replays cost the host nothing, each call's capture holds its own (layout.once_per_tensor).
    An op of its own (SEQUENCES), so that a traced launch records it as one call, which the graph makes once
    (lowering/traced.py share_repeats) and Inductor calls as it is: lowered by Inductor, the sort of the symbolic
    B·L flags would add a guard on the length (a recompile past 32,767 tokens)."""
    return SEQUENCES(keep)


def _derive_sequences(keep):
    order = torch.argsort((~keep.flatten()).to(torch.uint8), stable=True)
    kept = keep.sum(1, dtype=torch.int32)
    bounds = torch.cat([kept.new_zeros(1), kept.cumsum(0, dtype=torch.int32)])
    return order, bounds, torch.arange(keep.numel(), device=keep.device) >= bounds[-1]


def _sequences_fake(keep):
    tokens = keep.numel()
    return (keep.new_empty(tokens, dtype=torch.int64), keep.new_empty(keep.shape[0] + 1, dtype=torch.int32),
            keep.new_empty(tokens, dtype=torch.bool))


# A plain op of the dispatcher (as lowering/traced.py's ADDMM_), without torch.library.custom_op's Python layers
_LIBRARY = torch.library.Library("graphopt_padded", "DEF")
_LIBRARY.define("sequences(Tensor keep) -> (Tensor, Tensor, Tensor)")
_LIBRARY.impl("sequences", _derive_sequences, "CompositeExplicitAutograd")
torch.library.register_fake("graphopt_padded::sequences", _sequences_fake, lib=_LIBRARY)
SEQUENCES = torch.ops.graphopt_padded.sequences.default


@triton.jit(do_not_specialize=["length"])
def _rows_kernel(
    PADDED, FLAT, ORDER, KEPT, length, heads, dim,
    stride_pb, stride_ph, stride_pl, stride_pd, stride_fr, stride_fh, stride_fd,
    TO_FLAT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # flat row r holds the token at flat index ORDER[r] = b·length + t of the padded layout; the rows from KEPT[0]
    # (the batch's kept tokens) on are its padding: not moved to the flat layout, written as zeros back from it
    row = tl.program_id(0).to(tl.int64)
    index = tl.load(ORDER + row)
    batch = index // length
    position = index - batch * length
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    inside = (h < heads) & (d < dim)
    # the heads a kept token moves: all, or none (a product, as Triton's interpreter mishandles a scalar bool's &)
    moved = (h < heads * (row < tl.load(KEPT)).to(tl.int32)) & (d < dim)
    padded = PADDED + batch * stride_pb + position * stride_pl + h * stride_ph + d * stride_pd
    flat = FLAT + row * stride_fr + h * stride_fh + d * stride_fd
    if TO_FLAT:
        tl.store(flat, tl.load(padded, mask=moved), mask=moved)
    else:
        tl.store(padded, tl.load(flat, mask=moved, other=0.0), mask=inside)


def _move_rows(padded, flat, order, bounds, to_flat):
    """Between padded [B, H, L, D] (any strides) and flat [B·L, H, D] in `order`, either way: the padding's rows
    of flat neither written nor read, its tokens of padded written as zeros."""
    batch, heads, length, dim = padded.shape
    if layout.known_zero(batch * length):
        return
    block_h, block_d = layout.next_power_of_2(heads), layout.next_power_of_2(dim)
    layout.launcher(_rows_kernel)[(batch * length,)](
        padded, flat, order, bounds[batch:], length, heads, dim, *padded.stride(), *flat.stride(), TO_FLAT=to_flat,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=layout.num_warps(padded, 4 if block_h * block_d <= 4096 else 8))


def _flat(x, order, bounds):
    """x [B, H, L, D] → [B·L, H, D], the kept tokens first, in `order`; the padding's rows left unwritten."""
    batch, heads, length, dim = x.shape
    out = torch.empty(batch * length, heads, dim, dtype=x.dtype, device=x.device)
    _move_rows(x, out, order, bounds, to_flat=True)
    return out


def _unflat(y, order, bounds, batch, length):
    """The inverse of _flat: [B·L, H, D] in `order` → [B, H, L, D] stored [B, L, H, D] (the op's output layout),
    the padding's tokens zero. Allocated with its strides, not as a view: a traced launch's kernels write only
    tensors the trace made (lowering/traced.py)."""
    heads, dim = y.shape[1:]
    out = torch.empty_strided((batch, heads, length, dim), (length * heads * dim, dim, heads * dim, 1),
                              dtype=y.dtype, device=y.device)
    _move_rows(out, y, order, bounds, to_flat=False)
    return out


def longest_for_kernels(length):
    """The longest sequence, as the kernels are told it (it sizes their grid): at 1 the forward takes a decoding path
    that folds GQA's query heads into the sequence and assumes one query per sequence, which the padding's empty
    sequences break; 2 bounds it as well. A symbol's maximum where the launch is traced, which adds no guard."""
    return torch.sym_max(length, 2)


def window_sizes(window):
    """The flash kernels' keyword arguments for a sliding window of `window` positions (None: none): the query
    attends window - 1 keys before it and itself."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def padded_attention_forward(q, k, v, keep, scale, window=None):
    batch, _, length, _ = q.shape
    order, bounds, padding = _sequences(keep)
    longest = longest_for_kernels(length)
    out, lse = torch.ops.aten._flash_attention_forward(
        _flat(q, order, bounds), _flat(k, order, bounds), _flat(v, order, bounds), bounds, bounds, longest, longest,
        0.0, True, False, scale=scale, **window_sizes(window))[:2]
    # [heads, B·L] in `order`, of which the kernels write the kept tokens' rows only: the padding's set to 0, as the
    # reference's are (its rows in the reference's order; lse passes from this forward to this backward only)
    lse.masked_fill_(padding, 0.0)
    return _unflat(out, order, bounds, batch, length), lse


def padded_attention_backward(grad_out, q, k, v, keep, out, lse, scale, window=None):
    batch, _, length, _ = q.shape
    order, bounds, _ = _sequences(keep)
    longest = longest_for_kernels(length)
    # the RNG state dropout would have used, which the kernels read only with dropout: left unwritten, as a fill of
    # uint64 is not a kernel to leave to Inductor's code generation where the launch is traced
    no_dropout = torch.empty(2, dtype=torch.uint64, device=q.device)
    grads = torch.ops.aten._flash_attention_backward(
        *(_flat(t, order, bounds) for t in (grad_out, q, k, v, out)), lse, bounds, bounds, longest, longest, 0.0,
        True, no_dropout, torch.empty(0, device=q.device), scale=scale, **window_sizes(window))
    return tuple(_unflat(g, order, bounds, batch, length) for g in grads)
