"""graphopt::padded_attention and the attention_padded rewrite (passes/attention.py): causal attention over a padded
batch (HF's 2-D attention_mask), checked against an fp64 computation of SDPA with HF's mask at the kept queries,
0 at padding queries; opcheck; the rewrite on HF models at static and symbolic lengths, loss and gradients equal
to eager. On CUDA the op runs the flash variable-length kernels (kernels/padded_attention.py), in bf16 and fp16."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import graphopt
from graphs import relative_error
from models import ARCHITECTURES, SYMBOLIC_LENGTH, tiny_lora_model
from test_batches import compile_and_compare, loss_and_grads
from texts import VOCAB, pad_batch, sentences

OP = torch.ops.graphopt.padded_attention.default
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def keep_mask(lengths, length, left=False, holes=False, seed=0):
    """[B, L] bool: each row's first (or, left-padded, last) `lengths[b]` positions kept; with holes, random ones."""
    keep = torch.zeros(len(lengths), length, dtype=torch.bool)
    for row, n in enumerate(lengths):
        if holes:
            g = torch.Generator().manual_seed(seed + row)
            keep[row, torch.randperm(length, generator=g)[:n]] = True
        elif left:
            keep[row, length - n:] = True
        else:
            keep[row, :n] = True
    return keep


def causal(length, window, device):
    """HF's causal mask over indices, within its sliding window (sliding_window_overlay: kv > q - window) if any."""
    q_idx, kv_idx = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
    return (kv_idx <= q_idx) & (True if window is None else kv_idx > q_idx - window)


def exact(q, k, v, keep, scale, window=None):
    """fp64 SDPA with HF's mask (causal & attention_mask[b, kv], within the window), 0 at padding queries."""
    groups = q.shape[1] // k.shape[1]
    mask = causal(q.shape[2], window, q.device) & keep[:, None, None, :]
    out = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(groups, 1),
                                         v.double().repeat_interleave(groups, 1), attn_mask=mask, scale=scale)
    return (out * keep[:, None, :, None]).nan_to_num()


def inputs(batch, heads, kv_heads, length, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, length, dim, generator=g).to(device, dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def check(q, k, v, tokens, scale, tolerance, op=OP, expected_of=exact, window=None):
    """op's output and its gradients against expected_of's fp64 computation (packed_attention's test passes its
    own); returns the output."""
    out, _ = op(q, k, v, tokens, scale, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # laid out [B, L, H, D], as the fake says
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = expected_of(q64, k64, v64, tokens, scale, window)
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64), grad.double())
    assert relative_error(out, expected) <= tolerance
    # As one vector: at length 1, dq and dk are exactly 0 and 16-bit rounding leaves ~1e-7 in them
    assert relative_error(torch.cat([g.flatten() for g in grads]),
                          torch.cat([g.flatten() for g in expected_grads])) <= tolerance
    return out


@pytest.mark.parametrize("device", DEVICES)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 2), groups=st.sampled_from([1, 2, 4]),
       length=st.integers(1, 40), dim=st.sampled_from([8, 16, 64]), layout=st.sampled_from(["right", "left", "holes"]),
       data=st.data())
def test_matches_fp64(device, batch, kv_heads, groups, length, dim, layout, data):
    lengths = data.draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch))
    keep = keep_mask(lengths, length, left=layout == "left", holes=layout == "holes").to(device)
    # A window over rows with holes: the CUDA kernels count it over kept tokens (kernels/padded_attention.py)
    window = None if device == "cuda" and layout == "holes" else data.draw(st.none() | st.integers(1, length + 1))
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    for dtype in dtypes:
        q, k, v = inputs(batch, kv_heads * groups, kv_heads, length, dim, dtype, device, seed=length)
        out = check(q, k, v, keep, dim ** -0.5, 1e-5 if dtype == torch.float32 else 2e-2, window=window)
        assert torch.all(out.transpose(1, 2)[~keep] == 0)


# How q, k and v reach the attention ops: HF's projections give [B, H, L, D] views of [B, L, H, D]; RoPE's outputs
# are contiguous. The kernels' outputs must be laid out as the fakes say whichever comes (opcheck compares strides).
LAYOUTS = {"projection": lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),
           "contiguous": lambda x: x.contiguous()}


def opcheck_layouts(op, backward, q, k, v, mask, scale, window):
    """opcheck of the op and its backward on q, k and v in each of LAYOUTS."""
    for layout in LAYOUTS.values():
        q, k, v = (layout(t.detach()).requires_grad_() for t in (q, k, v))
        torch.library.opcheck(op, (q, k, v, mask, scale, window))
        out, lse = op(q, k, v, mask, scale, window)
        grad = torch.randn_like(out)
        torch.library.opcheck(backward, (grad, q.detach(), k.detach(), v.detach(), mask, out.detach(), lse, scale,
                                         window))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch, window", [(1, None), (2, None), (2, 5)])
def test_opcheck(device, batch, window):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CUDA: the flash kernels
    q, k, v = inputs(batch, 4, 2, 24, 64, dtype, device)
    keep = keep_mask([24, 13][:batch], 24).to(device)
    opcheck_layouts(OP, torch.ops.graphopt.padded_attention_backward.default, q, k, v, keep, 0.125, window)


@pytest.mark.skipif("cuda" not in DEVICES, reason="the flash kernels run on CUDA")
def test_cuda_runs_the_flash_kernels():
    """bf16 on CUDA takes the variable-length flash kernels (no [L × L] scores), fp32 the reference."""
    from graphopt.kernels import padded_attention

    q, k, v = inputs(2, 8, 2, 256, 64, torch.bfloat16, "cuda")
    assert padded_attention.supported(q, k, v)
    assert not padded_attention.supported(q.float(), k.float(), v.float())
    keep = keep_mask([256, 100], 256).cuda()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    OP(q, k, v, keep, 0.125)
    scores = 2 * 8 * 256 * 256 * 4
    assert torch.cuda.max_memory_allocated() - before < scores


@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=3), extra=st.integers(0, 3),
       kind=st.sampled_from(["right", "left", "holes"]), heads=st.integers(1, 5), dim=st.sampled_from([8, 24, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), stored_bhld=st.booleans())
def test_the_row_kernel_moves_tokens_as_indexing_does(lengths, extra, kind, heads, dim, dtype, stored_bhld):
    """kernels/padded_attention.py's reordering (Triton: on the GPU where there is one, else the interpreter on the
    CPU) against aten's indexing: the batch's kept tokens to the front of the flat layout, row after row, and back
    with the padding zero, from [B, H, L, D] stored either way; the sequences (graphopt_padded::sequences): the kept
    tokens' flat indices first, then the padding's, and the bounds one a row over its kept tokens."""
    from graphopt.kernels import padded_attention

    device = DEVICES[-1]
    length = max(lengths) + extra
    keep = keep_mask(lengths, length, left=kind == "left", holes=kind == "holes").to(device)
    g = torch.Generator().manual_seed(len(lengths) * 100 + length)
    shape = (len(lengths), heads, length, dim) if stored_bhld else (len(lengths), length, heads, dim)
    x = torch.randn(shape, generator=g).to(device, dtype)
    x = x if stored_bhld else x.transpose(1, 2)
    order, bounds, padding = padded_attention._sequences(keep)
    kept = keep.sum().item()
    flat = keep.flatten().tolist()
    assert order.tolist() == [i for i, k in enumerate(flat) if k] + [i for i, k in enumerate(flat) if not k]
    assert bounds.tolist() == [0, *keep.sum(1).cumsum(0).tolist()] and bounds.dtype == torch.int32
    assert padding.tolist() == [row >= kept for row in range(keep.numel())]
    tokens = x.transpose(1, 2).reshape(-1, heads, dim)  # [B·L, H, D], row b's token t at b·L + t
    assert torch.equal(padded_attention._flat(x, order, bounds)[:kept], tokens[keep.flatten()])
    back = padded_attention._unflat(tokens[order], order, bounds, len(lengths), length)
    assert back.shape == x.shape and back.transpose(1, 2).is_contiguous()
    assert torch.equal(back, x * keep[:, None, :, None])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", [[3, 0, 5], [7]], ids=["a row of padding only", "one row"])
def test_the_sequences_op_passes_opcheck(device, lengths):
    """graphopt_padded::sequences, the op that derives a batch's sequences once a graph where the launches are
    traced: its schema, fake and dispatch (torch.library.opcheck); its values, above."""
    from graphopt.kernels import padded_attention

    keep = keep_mask(lengths, 8, holes=True).to(device)
    torch.library.opcheck(padded_attention.SEQUENCES, (keep,))


# Mistral's sliding window (its mask adds kv > q - window) narrower than the sentences, so that it bites
WINDOWED = {"mistral": {"sliding_window": 6}}


def fused_attention(model, batches, pattern):
    """compile_and_compare's check, then every attention layer fused as `pattern`, no attention miss."""
    graphs, reports = compile_and_compare(model, batches)
    assert graphs == [1, 2][:len(batches)]  # the static graph, then the symbolic one
    for report in reports:
        assert report.summary().get(pattern) == model.config.num_hidden_layers
        assert not [m for m in report.misses if m.pattern.startswith("attention")]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_hf_padded_batches_fuse_and_train_the_same(arch, fresh_dynamo):
    """HF's padded batches at a static length, then (SYMBOLIC_LENGTH) a symbolic one: every attention layer
    fused, under Mistral's sliding window too, loss and gradients equal to eager (labels -100 at the padding, as
    HF's collators make them)."""
    model = tiny_lora_model(arch, vocab_size=VOCAB, **WINDOWED.get(arch, {}))
    data = sentences()
    batches = [pad_batch(rows) for rows in (data[0:4], data[8:12])][:2 if arch in SYMBOLIC_LENGTH else 1]
    fused_attention(model, batches, "attention_padded")


@pytest.mark.skipif("cuda" not in DEVICES, reason="CUDA graphs and the flash kernels need a GPU")
def test_cuda_graph_replays_of_padded_batches_of_one_length_attend_each_batchs_own_tokens(fresh_dynamo):
    """bf16 on CUDA, every batch padded to one length with padding of its own (a collator's pad_to_multiple_of):
    the static graph is recorded as CUDA graphs around the flash kernels, then replayed. Each step's loss and LoRA
    gradients are those of the same compile without CUDA graphs, so no replay reads the sequences of another
    batch or of another capture (layout.once_per_tensor keeps nothing from a capture: RESULTS.md SFT AK)."""
    from graphopt.kernels import padded_attention

    data = sentences()
    width = max(len(r["input_ids"]) for r in data[:16])
    batches = [{k: v.cuda() for k, v in pad_batch(data[i:i + 4], width).items()} for i in (0, 4, 8, 12, 0)]
    assert len({tuple(b["attention_mask"].sum(1).tolist()) for b in batches}) == 4
    model = tiny_lora_model("llama", torch.bfloat16, vocab_size=VOCAB, hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1).cuda()
    q, k, v = inputs(4, 2, 1, width, 64, torch.bfloat16, "cuda")
    assert padded_attention.supported(q, k, v)
    steps = {}
    for graphs in (False, True):
        torch._dynamo.reset()
        before = len(graphopt.reports())
        compiled = torch.compile(model, backend="graphopt", options={"cuda_graphs": graphs})
        steps[graphs] = []
        for batch in batches:  # CUDA graph trees: the first step warms up, the second records, the rest replay
            torch.compiler.cudagraph_mark_step_begin()
            steps[graphs].append(loss_and_grads(compiled, batch))
        (report,) = graphopt.reports()[before:]
        assert report.cuda_graphs["on"] == graphs
        assert report.summary().get("attention_padded") == model.config.num_hidden_layers
    for (loss, grads), (expected_loss, expected_grads) in zip(steps[True], steps[False]):
        assert relative_error(loss.float(), expected_loss.float()) <= 1e-2
        assert all(relative_error(grads[n].float(), expected_grads[n].float()) <= 1e-2 for n in grads)


def test_gemma3_sliding_window_layers_fuse_with_the_padding(fresh_dynamo):
    """Both layer kinds fused, each with its own mask (window 6 and none), at a static length and a symbolic one."""
    data = sentences()
    batches = [pad_batch(rows) for rows in (data[0:4], data[8:12])]
    fused_attention(tiny_lora_model("gemma3", vocab_size=VOCAB), batches, "attention_padded")
