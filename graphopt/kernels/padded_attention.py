"""graphopt::padded_attention on NVIDIA GPUs: FlashAttention-2's variable-length kernels (aten's
_flash_attention_forward/_backward), which skip what the mask excludes instead of computing it and masking.

Each row's kept tokens are gathered to its front, in order (a stable sort of the padding flags), and the batch is
handed to the kernels as 2·B causal sequences of one flat [B·L, H, D] layout: row b's kept tokens, then its padding.
The count is fixed (2·B), so nothing here waits for the GPU and a graph of symbolic length stays one graph. The
padding's own sequence computes something finite that the output then zeroes (the op's definition,
kernels/reference.py); its gradient is zeroed before the backward, so it contributes nothing.
"""

import torch

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


def _sequences(keep):
    """(each row's token order with its kept tokens first, cumulative sequence starts [2·B + 1] int32)."""
    batch, length = keep.shape
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)
    kept = keep.sum(1, dtype=torch.int32)
    starts = torch.arange(batch, dtype=torch.int32, device=keep.device) * length
    bounds = torch.stack([starts, starts + kept], dim=1).flatten()
    return order, torch.cat([bounds, bounds.new_full((1,), batch * length)])


def _flat(x, order):
    """x [B, H, L, D] → [B·L, H, D], each row's tokens in `order`."""
    batch, heads, length, dim = x.shape
    rows = torch.arange(batch, device=x.device)[:, None]
    return x.transpose(1, 2)[rows, order].reshape(batch * length, heads, dim)


def _unflat(y, order, batch, length):
    """The inverse of _flat: [B·L, H, D] in `order` → [B, L, H, D]."""
    y = y.view(batch, length, *y.shape[1:])
    out = torch.empty_like(y)
    out[torch.arange(batch, device=y.device)[:, None], order] = y
    return out


def longest_for_kernels(length):
    """The longest sequence, as the kernels are told it (it sizes their grid): at 1 the forward takes a decoding path
    that folds GQA's query heads into the sequence and assumes one query per sequence, which the padding's empty
    sequences break; 2 bounds it as well."""
    return max(length, 2)


def padded_attention_forward(q, k, v, keep, scale):
    batch, _, length, _ = q.shape
    order, bounds = _sequences(keep)
    longest = longest_for_kernels(length)
    out, lse = torch.ops.aten._flash_attention_forward(
        _flat(q, order), _flat(k, order), _flat(v, order), bounds, bounds, longest, longest, 0.0, True, False,
        scale=scale)[:2]
    out = _unflat(out, order, batch, length) * keep[:, :, None, None]
    return out.transpose(1, 2), lse


def padded_attention_backward(grad_out, q, k, v, keep, out, lse, scale):
    batch, _, length, _ = q.shape
    order, bounds = _sequences(keep)
    longest = longest_for_kernels(length)
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the RNG state dropout would have used
    grads = torch.ops.aten._flash_attention_backward(
        _flat(grad_out * keep[:, None, :, None], order), _flat(q, order), _flat(k, order), _flat(v, order),
        _flat(out, order), lse, bounds, bounds, longest, longest, 0.0, True, no_dropout,
        torch.empty(0, device=q.device), scale=scale)
    return tuple(_unflat(g, order, batch, length).transpose(1, 2) for g in grads)
