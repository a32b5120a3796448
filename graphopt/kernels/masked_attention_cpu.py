"""graphopt::padded_attention and packed_attention on the CPU: aten's CPU flash-attention kernels
(_scaled_dot_product_flash_attention_for_cpu and its backward), what eager SDPA runs there for a masked call, given
the op's mask as an additive one. Blocked like the GPU kernels, they never hold the [L × L] scores in fp32, which the
reference (kernels/reference.py) does, at a cost that grows with the square of a packed row's thousands of tokens.

A query that attends nothing (padding) comes out 0, with its gradient zeroed before the backward, as the op says.
k and v are repeated to the query heads (the kernels take no GQA), and their gradients summed back.
"""

import torch

from graphopt.kernels.reference import packed_attends, padded_attends

_ATEN = torch.ops.aten


def _additive(attends, dtype):
    return torch.zeros(attends.shape, dtype=dtype, device=attends.device).masked_fill(~attends, float("-inf"))


def _repeated(q, x):
    return x.repeat_interleave(q.shape[1] // x.shape[1], dim=1)


def _forward(q, k, v, attends, scale):
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(
        q, _repeated(q, k), _repeated(q, v), 0.0, False, attn_mask=_additive(attends, q.dtype), scale=scale)
    batch, heads, length, _ = q.shape
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # stored [B, L, H, D], the op's layout
    return out, lse.transpose(0, 1).reshape(heads, batch * length)


def _backward(grad_out, q, k, v, attends, out, lse, scale):
    batch, heads, length, dim = q.shape
    grad = (grad_out * attends.any(-1)[..., None]).to(q.dtype)
    dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, _repeated(q, k), _repeated(q, v), out, lse.view(heads, batch, length).transpose(0, 1).contiguous(),
        0.0, False, attn_mask=_additive(attends, q.dtype), scale=scale)

    def per_kv_head(x):  # [B, H, L, D] → [B, Hk, L, D] stored [B, L, Hk, D]
        x = x.view(batch, k.shape[1], heads // k.shape[1], length, dim).sum(2)
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    return dq.transpose(1, 2).contiguous().transpose(1, 2), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def padded_attention(q, k, v, keep, scale, window=None):
    return _forward(q, k, v, padded_attends(keep, window), scale)


def padded_attention_backward(grad_out, q, k, v, keep, out, lse, scale, window=None):
    return _backward(grad_out, q, k, v, padded_attends(keep, window), out, lse, scale)


def packed_attention(q, k, v, position_ids, scale, window=None):
    return _forward(q, k, v, packed_attends(position_ids, window), scale)


def packed_attention_backward(grad_out, q, k, v, position_ids, out, lse, scale, window=None):
    return _backward(grad_out, q, k, v, packed_attends(position_ids, window), out, lse, scale)
