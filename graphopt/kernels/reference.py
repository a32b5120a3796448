"""Pure-torch references of every graphopt op: the definition of correct (fp32 math; fp64 for fp64 inputs).

Kept free of Triton so every device, and every test, can run them.

RMSNorm:  y = x * rsqrt(mean(x², last dim) + eps) * (weight + weight_offset), rounded once to out_dtype.
`weight_offset` is 0 for Llama-style norms and 1 for Gemma's `(1 + weight)`.
"""

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x, weight, eps, weight_offset, out_dtype):
    xf = x.to(_compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(xf.dtype) + weight_offset)
    return y.to(out_dtype)


def rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad):
    xf = x.to(_compute_dtype(x))
    dy = grad_out.to(xf.dtype)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * rstd
    g = dy * (weight.to(xf.dtype) + weight_offset) if weight is not None else dy
    grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    if compute_weight_grad:
        grad_w = (dy * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    else:
        grad_w = x.new_empty(0)
    return grad_x.to(x.dtype), grad_w


# Gated activations: h = act(gate) * up, act = silu (SwiGLU) or tanh-approximate gelu (GeGLU).
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def _activation(gate, activation):
    if activation == "silu":
        return torch.nn.functional.silu(gate)
    return torch.nn.functional.gelu(gate, approximate="tanh")


def gated_activation(gate, up, activation):
    dtype = _compute_dtype(gate)
    return (_activation(gate.to(dtype), activation) * up.to(dtype)).to(gate.dtype)


def gated_activation_backward(grad_out, gate, up, activation):
    dtype = _compute_dtype(gate)
    g, u, dh = gate.to(dtype), up.to(dtype), grad_out.to(dtype)
    if activation == "silu":
        s = torch.sigmoid(g)
        act, dact = g * s, s * (1 + g * (1 - s))
    else:  # with s = sigmoid(2u) = (1 + tanh(u)) / 2, which keeps the far negative tail accurate
        k = 0.7978845608028654  # sqrt(2 / pi)
        s = torch.sigmoid(2 * k * (g + 0.044715 * g.pow(3)))
        act = g * s
        dact = s + 2 * g * s * (1 - s) * k * (1 + 3 * 0.044715 * g * g)
    return (dh * u * dact).to(gate.dtype), (dh * act).to(up.dtype)


# RoPE (HF's rotate_half form): on the first R = cos.shape[-1] channels of each head, with x = (x1, x2) its two
# halves, y = x·cos + rotate_half(x)·sin = (x1·c1 − x2·s1, x2·c2 + x1·s2); channels R..D pass through (Phi-3's
# partial rotary). q [B, Hq, S, D] and k [B, Hk, S, D] share cos/sin [B or 1, S, R] (HF's cos before its
# unsqueeze(1) over heads). cos/sin get no gradient.

def _rotate(x, cos, sin):
    dtype = torch.promote_types(_compute_dtype(x), cos.dtype)
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    xf, c, s = x.to(dtype), cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
    x1, x2 = xf[..., :half], xf[..., half:rot]
    y1 = x1 * c[..., :half] - x2 * s[..., :half]
    y2 = x2 * c[..., half:] + x1 * s[..., half:]
    return torch.cat([y1, y2, xf[..., rot:]], dim=-1).to(x.dtype)


def rope(q, k, cos, sin):
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rope_backward(grad_q, grad_k, cos, sin):
    """The transposed rotation: dx1 = g1·c1 + g2·s2, dx2 = g2·c2 − g1·s1, i.e. the forward with sin replaced by
    −(its halves swapped). (Only when sin's halves are equal, as HF's are, is this "sin negated".)"""
    half = sin.shape[-1] // 2
    sin_t = -torch.cat([sin[..., half:], sin[..., :half]], dim=-1)
    return _rotate(grad_q, cos, sin_t), _rotate(grad_k, cos, sin_t)


# LoRA linear (PEFT): out = (x·Wᵀ + b + (drop(x as adapter dtype)·Aᵀ)·Bᵀ · scaling) as out_dtype, the same
# operations in the same dtypes as PEFT's eager forward. Only A and B train; the base weight and bias are frozen.
# drop is PEFT's lora_dropout in training: with a keep mask (bool, x's shape) drawn for the step, drop(v) =
# v · mask · 1/(1 − p), the arithmetic of torch's dropout; without one, the identity. It is two ops: lora_down
# computes xa = drop(x as adapter dtype)·Aᵀ [..., rank], the low-rank input of B, and lora_linear the rest from
# it; the backward takes xa as saved, as PEFT's autograd saves it, where recomputing it would read x once more.

def _dropped(v, dropout_mask, dropout_p):
    return v if dropout_mask is None else v * dropout_mask * (1.0 / (1.0 - dropout_p))


def lora_down(x, lora_a, dropout_mask=None, dropout_p=0.0):
    return torch.nn.functional.linear(_dropped(x.to(lora_a.dtype), dropout_mask, dropout_p), lora_a)


def lora_linear(x, weight, bias, lora_a, lora_b, xa, scaling, out_dtype, dropout_mask=None, dropout_p=0.0):
    """lora_a and the dropout made xa (lora_down); the backward reads them."""
    base = torch.nn.functional.linear(x, weight, bias)
    lora = torch.nn.functional.linear(xa, lora_b) * scaling
    # the add in out_dtype where it is the wider: PEFT's 4-bit layer under autocast adds a base it cast back up
    return (base.to(torch.promote_types(base.dtype, out_dtype)) + lora).to(out_dtype)


def lora_linear_backward(grad_out, x, xa, weight, lora_a, lora_b, scaling, dropout_mask=None, dropout_p=0.0):
    """(grad_x, grad_a, grad_b), from x and the forward's xa. The adapter-dtype copy of x (dropped) is recomputed
    here, never saved; the dropout's gradient goes through the same mask."""
    base_dtype = torch.promote_types(x.dtype, weight.dtype)
    grad = grad_out.to(torch.promote_types(base_dtype, lora_b.dtype))
    grad_lora = (grad * scaling).to(lora_b.dtype).reshape(-1, lora_b.shape[0])
    mask = None if dropout_mask is None else dropout_mask.reshape(-1, x.shape[-1])
    x_adapter = _dropped(x.to(lora_a.dtype).reshape(-1, x.shape[-1]), mask, dropout_p)
    grad_b = grad_lora.t() @ xa.reshape(-1, lora_a.shape[0])
    grad_xa = grad_lora @ lora_b
    grad_a = grad_xa.t() @ x_adapter
    grad_x_lora = _dropped(grad_xa @ lora_a, mask, dropout_p).to(x.dtype).reshape(x.shape)
    grad_x = (grad.to(base_dtype) @ weight).to(x.dtype) + grad_x_lora
    return grad_x, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype)


# QLoRA: a bitsandbytes 4-bit base (NF4 or FP4 codes, one absmax a block; with double quantization the absmax
# themselves 8-bit, blockwise over 256) and its LoRA adapters: lora_linear over the dequantized weight, which is
# made for the call and never kept. The weight is dequantized by bitsandbytes' own ops, so the op and its kernels
# are checked against the library, not against a reading of its format. The arguments are those of
# bitsandbytes::gemm_4bit, which bitsandbytes' 4-bit matmul calls: with double quantization `absmax` is the nested
# absmax and absmax_8bit, absmax_code, absmax_offset the blocks' 8-bit absmax, its code and its offset.

NESTED_BLOCKSIZE = 256  # bitsandbytes' 4-bit matmul takes double-quantized absmax in blocks of 256 only


def dequantize_4bit(packed, shape, absmax, blocksize, quant_type, absmax_8bit, absmax_code, absmax_offset, dtype):
    """The [out, in] base weight, in dtype, from bitsandbytes' packed codes and quantization state."""
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes; a model with a 4-bit base has it)

    if absmax_8bit is not None:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise(absmax_8bit, absmax, absmax_code, NESTED_BLOCKSIZE,
                                                             torch.float32) + absmax_offset
    return torch.ops.bitsandbytes.dequantize_4bit(packed, absmax, blocksize, quant_type, list(shape), dtype)


def lora_linear_4bit(x, packed, shape, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code,
                     absmax_offset, lora_a, lora_b, xa, scaling, out_dtype, dropout_mask=None, dropout_p=0.0):
    weight = dequantize_4bit(packed, shape, absmax, blocksize, quant_type, absmax_8bit, absmax_code, absmax_offset,
                             x.dtype)
    return lora_linear(x, weight, bias, lora_a, lora_b, xa, scaling, out_dtype)


def lora_linear_4bit_backward(grad_out, x, xa, packed, shape, absmax, blocksize, quant_type, absmax_8bit,
                              absmax_code, absmax_offset, lora_a, lora_b, scaling, dropout_mask=None, dropout_p=0.0):
    """(grad_x, grad_a, grad_b), the base weight dequantized again."""
    weight = dequantize_4bit(packed, shape, absmax, blocksize, quant_type, absmax_8bit, absmax_code, absmax_offset,
                             x.dtype)
    return lora_linear_backward(grad_out, x, xa, weight, lora_a, lora_b, scaling, dropout_mask, dropout_p)


# Linear + cross-entropy (lm_head → loss), in row chunks so the [tokens × vocab] logits never exist at once:
#   logits = hidden·Wᵀ (+ b) in hidden's dtype, as HF's lm_head; z = logits in fp32; with softcap c > 0,
#   z = c·tanh(z / c) (Gemma-2); loss_i = logsumexp(z_i) − z_i[target_i], rows with target = ignore_index add 0;
#   "sum" → Σ loss_i, "mean" → Σ loss_i / #valid rows (NaN when no row is valid, as F.cross_entropy).
# When asked, the gradients of that loss w.r.t. hidden and weight are produced in the same pass over each chunk
# (the logits of a chunk are needed for both), scaled by 1/#valid for "mean", with no gradient (exact zeros) for
# ignored rows; the backward then only multiplies them by the incoming gradient.

def chunk_loss(z, target, keep, ignore_index):
    """(Σ loss over the chunk's kept rows, log-probabilities) of logits z [rows, V] in the compute dtype."""
    lse = torch.logsumexp(z, dim=-1)
    safe_t = torch.where(keep, target, 0).unsqueeze(1)
    return torch.where(keep, lse - z.gather(1, safe_t).squeeze(1), 0).sum(), z - lse.unsqueeze(1)


def linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows,
                         grad_hidden, grad_weight, chunk_loss=chunk_loss):
    """(loss, d loss/d hidden or an empty tensor, d loss/d weight or an empty tensor); hidden [N, H], target [N].
    chunk_loss computes each chunk's loss and log-probabilities (a target's fused operator may, lowering/)."""
    dtype = _compute_dtype(hidden)
    valid = target != ignore_index
    count = valid.sum()
    # Gradient scale per row: "mean" divides by the valid count; none at all when no row is valid.
    scale = 1 / count.clamp_min(1).to(dtype) if reduction == "mean" else torch.ones((), dtype=dtype)
    loss = torch.zeros((), dtype=dtype, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    d_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if grad_weight else weight.new_empty(0)
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        h, t, keep = hidden[rows], target[rows], valid[rows]
        z = torch.nn.functional.linear(h, weight, bias).to(dtype)
        if softcap > 0:
            capped = torch.tanh(z / softcap)
            z = capped * softcap
        chunk_sum, log_prob = chunk_loss(z, t, keep, ignore_index)
        loss = loss + chunk_sum
        if not (grad_hidden or grad_weight):
            continue
        dz = torch.exp(log_prob)
        safe_t = torch.where(keep, t, 0).unsqueeze(1)
        dz.scatter_add_(1, safe_t, torch.full_like(safe_t, -1, dtype=dtype))
        dz *= (keep.to(dtype) * scale).unsqueeze(1)
        if softcap > 0:
            dz *= 1 - capped * capped
        dz = dz.to(hidden.dtype)  # as eager's backward of logits.float()
        if grad_hidden:
            d_hidden[rows] = dz @ weight
        if grad_weight:
            d_weight += (dz.t() @ h).to(dtype)
    loss = loss / count if reduction == "mean" else loss
    return loss, d_hidden, d_weight.to(weight.dtype) if grad_weight else d_weight


def linear_cross_entropy_backward(grad_loss, d_hidden, d_weight):
    """The forward's gradients times the incoming one; ignored rows stay exact zeros even when it is inf or NaN
    (HF's num_items_in_batch = 0), as in eager, where those rows never see it."""
    def scaled(d):
        return torch.where(d == 0, 0, d * grad_loss).to(d.dtype)

    return scaled(d_hidden), scaled(d_weight)


# Linear log-probabilities (TRL's chunked log-prob head, trl/kernels/chunked_logprob.py): per-token statistics of
# the next-token distribution of a linear head, in row chunks so the [tokens × vocab] logits never exist at once.
#   y = hidden·Wᵀ (+ b), hidden, W and b cast to compute_dtype (autocast's dtype, else hidden's), read in fp32;
#   z = y·logit_scale; with softcap c > 0, z = c·tanh(z / c); z = z·(1 / temperature) (that order, as TRL).
# Per row, with lse = logsumexp(z) and p = softmax(z):
#   log_probs = z[target] − lse; entropy = −Σ p·log p = lse − Σ p·z; log_sum_sq_probs = log Σ p²;
#   mean_logits = mean(z); is_top1 = target is the first maximum of z (argmax); log_z = lse, kept for the backward.
# Outputs not asked for are empty tensors. Every row has a target in [0, vocab): positions without a label are
# scored with any label and masked by the caller, as TRL does.
# The backward recomputes each chunk's logits and takes d log_probs/dz = onehot − p and d entropy/dz = −p·(log p +
# entropy), through 1/temperature, the softcap's 1 − tanh² and logit_scale; that gradient of y is rounded to
# compute_dtype (as TRL writes it over its logits tile) and the gradients of hidden and W are accumulated in fp32,
# then returned in their own dtypes.

def _logprob_stats_dtype(compute_dtype):
    return torch.promote_types(compute_dtype, torch.float32)


def _head_logits(h, weight, bias, logit_scale, softcap, temperature):
    """(z, tanh(y·logit_scale / softcap) or None) of one chunk of rows, in the statistics' dtype."""
    y = h @ weight.t()
    if bias is not None:  # added to the rounded product, as TRL's tile is
        y = y + bias
    z = y.to(_logprob_stats_dtype(y.dtype)) * logit_scale
    capped = None
    if softcap > 0:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    return z * (1 / temperature), capped  # times 1/temperature, as TRL rounds it


def _head_in(weight, bias, compute_dtype):
    return weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype)


def linear_logprobs(hidden, weight, bias, targets, temperature, softcap, logit_scale, compute_dtype, entropy,
                    log_sum_sq_probs, mean_logits, is_top1, chunk_rows):
    """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, log_z), each [N] (empty when not asked);
    hidden [N, H], weight [V, H], targets [N]."""
    torch._check(bool(((targets >= 0) & (targets < weight.shape[0])).all()),
                 lambda: "linear_logprobs: a target is outside [0, vocab)")
    stats = _logprob_stats_dtype(compute_dtype)
    rows, device = hidden.shape[0], hidden.device
    w, b = _head_in(weight, bias, compute_dtype)
    log_probs, log_z = torch.empty(rows, dtype=stats, device=device), torch.empty(rows, dtype=stats, device=device)
    wanted = dict(entropy=entropy, log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits)
    extras = {name: torch.empty(rows if on else 0, dtype=stats, device=device) for name, on in wanted.items()}
    top1 = torch.empty(rows if is_top1 else 0, dtype=torch.bool, device=device)
    for start in range(0, rows, chunk_rows):
        part = slice(start, start + chunk_rows)
        z, _ = _head_logits(hidden[part].to(compute_dtype), w, b, logit_scale, softcap, temperature)
        lse = torch.logsumexp(z, dim=-1)
        t = targets[part].unsqueeze(1)
        log_z[part] = lse
        log_probs[part] = z.gather(1, t).squeeze(1) - lse
        if entropy:
            extras["entropy"][part] = lse - (torch.exp(z - lse.unsqueeze(1)) * z).sum(-1)
        if log_sum_sq_probs:
            extras["log_sum_sq_probs"][part] = torch.logsumexp(2 * z, dim=-1) - 2 * lse
        if mean_logits:
            extras["mean_logits"][part] = z.mean(-1)
        if is_top1:
            top1[part] = z.argmax(-1) == targets[part]
    return log_probs, extras["entropy"], extras["log_sum_sq_probs"], extras["mean_logits"], top1, log_z


def linear_logprobs_backward(grad_log_probs, grad_entropy, hidden, weight, bias, targets, log_z, entropy,
                             temperature, softcap, logit_scale, compute_dtype, chunk_rows, grad_hidden, grad_weight):
    """(d hidden or an empty tensor, d weight or an empty tensor) from the incoming gradients of log_probs and of
    entropy (an empty grad_entropy: the entropy was not computed, so no term)."""
    stats = _logprob_stats_dtype(compute_dtype)
    w, b = _head_in(weight, bias, compute_dtype)
    d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if grad_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=stats, device=weight.device) if grad_weight else None
    g_log_probs = grad_log_probs.to(stats)
    g_entropy = grad_entropy.to(stats) if grad_entropy.numel() else None
    for start in range(0, hidden.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        h = hidden[part].to(compute_dtype)
        z, capped = _head_logits(h, w, b, logit_scale, softcap, temperature)
        log_p = z - log_z[part].unsqueeze(1)
        p = torch.exp(log_p)
        dz = -p
        dz.scatter_add_(1, targets[part].unsqueeze(1), torch.ones_like(p[:, :1]))
        dz *= g_log_probs[part].unsqueeze(1)
        if g_entropy is not None:
            dz -= g_entropy[part].unsqueeze(1) * p * (log_p + entropy[part].unsqueeze(1))
        dz = dz * (1 / temperature)
        if capped is not None:
            dz = dz * (1 - capped * capped)
        dy = (dz * logit_scale).to(compute_dtype).to(stats)
        if grad_hidden:
            d_hidden[part] = (dy @ w.to(stats)).to(hidden.dtype)
        if grad_weight:
            d_weight += dy.t() @ h.to(stats)
    return (d_hidden if grad_hidden else hidden.new_empty(0),
            d_weight.to(weight.dtype) if grad_weight else weight.new_empty(0))


# Attention over a padded batch (HF's causal mask with a 2-D attention_mask, rows padded left, right or anywhere):
# query i of row b attends key j when j ≤ i and keep[b, j]; a padding query (keep[b, i] False) attends nothing and
# its output is 0, as HF's flash-attention path gives it (eager SDPA lets it attend the row's tokens: a value no
# kept position reads). q [B, H, L, D]; k, v [B, Hk, L, D] with query head h reading key/value head h // (H / Hk)
# (GQA). Outputs are laid out [B, L, H, D] in memory (the view [B, H, L, D]), as HF transposes them next.
# lse [H, B·L] fp32 carries the forward's softmax normalizers to its backward, in the implementation's own token
# order; this reference recomputes them there.
#
# Attention over a packed batch (padding-free, HF's DataCollatorWithFlattening): each row holds documents one
# after another, and position_ids [B, L] restart at each: a document starts at a row's first token and wherever
# a position is not the one before it plus 1. Query i attends key j when j ≤ i in the same document, as HF's mask
# from position_ids says (masking_utils.find_packed_sequence_indices). Same layouts as the padded batch's.
#
# Under a sliding window of size w (Mistral's, Gemma-3's local layers; HF's sliding_window_overlay), query i also
# needs i - j < w: it attends its w latest positions, itself included. None: no window.

def _heads_major(x):
    """x [B, H, L, D] stored [B, L, H, D]: the layout every padded_attention implementation returns."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _causal(length, window, device):
    """[L, L] bool: j ≤ i, and i - j < window where given."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return causal if window is None else causal.triu(1 - window)


def padded_attends(keep, window=None):
    """[B, 1, L, L] bool: query i attends key j (causal, within the window, both kept)."""
    return _causal(keep.shape[1], window, keep.device) & keep[:, None, None, :] & keep[:, None, :, None]


def document_starts(position_ids):
    """[B, L] bool: where a document of a packed row starts (out of place: the CPU lowering traces it into graphs)."""
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, position_ids[:, 1:] != position_ids[:, :-1] + 1], dim=1)


def packed_attends(position_ids, window=None):
    """[B, 1, L, L] bool: query i attends key j (causal, within the window, one document)."""
    documents = document_starts(position_ids).cumsum(-1)
    causal = _causal(position_ids.shape[1], window, position_ids.device)
    return causal & (documents[:, None, :, None] == documents[:, None, None, :])


def _masked_scores(q, k, attends, scale):
    """(scaled scores with -inf where not attended, the rows' log-sum-exp with 0 where a query attends nothing),
    fp32 math."""
    dtype = _compute_dtype(q)
    groups = q.shape[1] // k.shape[1]
    scores = torch.matmul(q.to(dtype), k.to(dtype).repeat_interleave(groups, dim=1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~attends, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~attends.any(-1), 0.0)
    return scores, lse


def _masked_attention(q, k, v, attends, scale):
    scores, lse = _masked_scores(q, k, attends, scale)
    probs = torch.exp(scores - lse[..., None])  # 0 where not attended, and in the rows of queries attending nothing
    groups = q.shape[1] // k.shape[1]
    out = torch.matmul(probs, v.to(probs.dtype).repeat_interleave(groups, dim=1))
    batch, heads, length = lse.shape
    return _heads_major(out.to(q.dtype)), lse.transpose(0, 1).reshape(heads, batch * length).float()


def _masked_attention_backward(grad_out, q, k, v, attends, scale):
    """(dq, dk, dv), laid out as the forward's output; dk and dv summed over the query heads sharing them."""
    scores, row_lse = _masked_scores(q, k, attends, scale)
    probs = torch.exp(scores - row_lse[..., None])
    batch, heads, length, _ = q.shape
    groups = heads // k.shape[1]
    dtype = probs.dtype
    grad = grad_out.to(dtype) * attends.any(-1)[..., None]  # a query attending nothing outputs 0, a constant
    k_rep, v_rep = (t.to(dtype).repeat_interleave(groups, dim=1) for t in (k, v))
    grad_probs = torch.matmul(grad, v_rep.transpose(-1, -2))
    grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
    dq = torch.matmul(grad_scores, k_rep) * scale
    dk = torch.matmul(grad_scores.transpose(-1, -2), q.to(dtype)) * scale
    dv = torch.matmul(probs.transpose(-1, -2), grad)

    def per_kv_head(x):
        return x.view(batch, k.shape[1], groups, length, x.shape[-1]).sum(2)

    return (_heads_major(dq.to(q.dtype)), _heads_major(per_kv_head(dk).to(k.dtype)),
            _heads_major(per_kv_head(dv).to(v.dtype)))


def padded_attention(q, k, v, keep, scale, window=None):
    return _masked_attention(q, k, v, padded_attends(keep, window), scale)


def padded_attention_backward(grad_out, q, k, v, keep, out, lse, scale, window=None):
    return _masked_attention_backward(grad_out, q, k, v, padded_attends(keep, window), scale)


def packed_attention(q, k, v, position_ids, scale, window=None):
    return _masked_attention(q, k, v, packed_attends(position_ids, window), scale)


def packed_attention_backward(grad_out, q, k, v, position_ids, out, lse, scale, window=None):
    return _masked_attention_backward(grad_out, q, k, v, packed_attends(position_ids, window), scale)
