"""graphopt::packed_attention on NVIDIA GPUs: FlashAttention-2's variable-length kernels (aten's
_flash_attention_forward/_backward) with one causal sequence per document of the packed batch.

The tokens are already one document after another, so [B, H, L, D] is handed over as the flat [B·L, H, D] layout
it is stored in (HF's q, k and v are transposed views of [B, L, H, D]: no copy). The documents' bounds come from
position_ids on the device; their count and the longest document are read on the host (the kernels size their
grid by them), one wait for the GPU per batch: every layer's forward and backward reads the same position_ids, and
finds its documents once (layout.once_per_tensor). HF's own flash path waits in every layer. That wait is why the
op is not captured in CUDA graphs (lowering/ops.py).
"""

import torch

from graphopt.kernels.layout import once_per_tensor
from graphopt.kernels.padded_attention import longest_for_kernels, window_sizes
from graphopt.kernels.reference import document_starts


@once_per_tensor
def _documents(position_ids):
    """(cumulative document starts [n + 1] int32 over the flattened batch, the longest document's length). The
    document count and the longest come to the host in one transfer, the batch's one wait for the GPU."""
    batch, length = position_ids.shape
    starts = document_starts(position_ids).flatten()
    index = torch.arange(batch * length, device=position_ids.device)
    start_of_document = torch.where(starts, index, 0).cummax(0).values
    count, longest = torch.stack([starts.sum(), (index - start_of_document).max() + 1]).tolist()  # waits
    bounds = torch.cat([torch.nonzero_static(starts, size=count).flatten(), index.new_full((1,), batch * length)])
    return bounds.to(torch.int32), longest_for_kernels(longest)


def _flat(x):
    """x [B, H, L, D] → [B·L, H, D] (a view when x is laid out [B, L, H, D])."""
    batch, heads, length, dim = x.shape
    return x.transpose(1, 2).reshape(batch * length, heads, dim)


def _unflat(y, batch, length):
    """[B·L, H, D] → [B, H, L, D] stored [B, L, H, D], the op's output layout. The kernels lay their outputs out
    as their inputs: a [1, H, L, D] q stored as it is ([H, L, D] after RoPE) flattens without a copy to a
    [L, H, D] view of strides (D, L·D, 1), and so does the output, which then takes the copy."""
    return y.contiguous().view(batch, length, *y.shape[1:]).transpose(1, 2)


def packed_attention_forward(q, k, v, position_ids, scale, window=None):
    batch, _, length, _ = q.shape
    bounds, longest = _documents(position_ids)
    out, lse = torch.ops.aten._flash_attention_forward(
        _flat(q), _flat(k), _flat(v), bounds, bounds, longest, longest, 0.0, True, False, scale=scale,
        **window_sizes(window))[:2]
    return _unflat(out, batch, length), lse


def packed_attention_backward(grad_out, q, k, v, position_ids, out, lse, scale, window=None):
    batch, _, length, _ = q.shape
    bounds, longest = _documents(position_ids)
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the RNG state dropout would have used
    grads = torch.ops.aten._flash_attention_backward(
        _flat(grad_out), _flat(q), _flat(k), _flat(v), _flat(out), lse, bounds, bounds, longest, longest, 0.0, True,
        no_dropout, torch.empty(0, device=q.device), scale=scale, **window_sizes(window))
    return tuple(_unflat(g, batch, length) for g in grads)
