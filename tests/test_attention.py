"""passes/attention.py: a causal mask built from sizes becomes is_causal=True and repeat_kv's copies become
enable_gqa=True, only where that is provably the same attention; everything else stays, with a miss record."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from graphs import first_output, relative_error, run_pass
from graphopt.passes.attention import rewrite_attention
from models import ARCHITECTURES, tiny_lora_model
from test_end_to_end import compile_and_compare

SDPA = F.scaled_dot_product_attention


def repeat_kv(x, n):  # HF's, verbatim
    b, h, s, d = x.shape
    if n == 1:
        return x
    x = x[:, :, None, :, :].expand(b, h, n, s, d)
    return x.reshape(b, h * n, s, d)


def causal_bool(q, k):  # transformers 5.17's sdpa_mask under torch.compile: aranges compared, expanded to batch
    kv_idx = (torch.arange(k.shape[-2], device=q.device) + 0)[None, None, None, :]
    q_idx = (torch.arange(q.shape[-2], device=q.device) + 0)[None, None, :, None]
    return (kv_idx <= q_idx).expand(q.shape[0], -1, q.shape[-2], k.shape[-2])


def causal_float(q, k):  # older transformers: an additive mask of 0 and the dtype's lowest value
    allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)


def hf_attention(mask_of, positional=False):
    def attention(q, k, v):
        n = q.shape[1] // k.shape[1]
        if positional:
            return SDPA(q, repeat_kv(k, n), repeat_kv(v, n), mask_of(q, k), 0.0, False)
        return SDPA(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask_of(q, k), is_causal=False)
    return attention


def qkv(batch, heads, kv_heads, seq, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, seq, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)]


def sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is SDPA]


def exact_attention(q, k, v):  # fp64, causal, GQA by repeat: what every rewritten call must compute
    n = q.shape[1] // k.shape[1]
    q, k, v = q.double(), repeat_kv(k, n).double(), repeat_kv(v, n).double()
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("positional", [False, True], ids=["keywords", "positional"])
@pytest.mark.parametrize("mask_of", [causal_bool, causal_float], ids=["bool", "float"])
def test_causal_mask_and_repeat_kv_become_is_causal_and_gqa(mask_of, positional):
    args = qkv(2, 8, 2, 16, 8, torch.float32)
    gm, inputs, expected, report, rewritten = run_pass(rewrite_attention, hf_attention(mask_of, positional), *args)
    assert rewritten == 2
    assert [r.pattern for r in report.fusions] == ["attention_causal", "attention_gqa"] and not report.misses
    (sdpa,) = sdpa_nodes(gm)
    assert sdpa.kwargs["attn_mask"] is None and sdpa.kwargs["is_causal"] and sdpa.kwargs["enable_gqa"]
    assert [a.meta["example_value"].shape[1] for a in sdpa.args[1:]] == [2, 2]  # k and v not repeated
    remaining = {n.target for n in gm.graph.nodes if n.op != "placeholder" and n.op != "output"}
    assert not remaining & {torch.arange, "expand", "reshape"}  # mask and copies erased
    assert relative_error(first_output(gm, inputs), expected) <= 1e-6


@given(batch=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
       seq=st.integers(1, 40), head_dim=st.sampled_from([8, 16, 64]), dtype=st.sampled_from([torch.float32,
       torch.bfloat16]), float_mask=st.booleans())
def test_rewritten_attention_matches_fp64(batch, kv_heads, group, seq, head_dim, dtype, float_mask):
    args = qkv(batch, kv_heads * group, kv_heads, seq, head_dim, dtype, seed=seq)
    mask_of = causal_float if float_mask else causal_bool
    gm, inputs, expected, report, _ = run_pass(rewrite_attention, hf_attention(mask_of), *args)
    assert "attention_causal" in [r.pattern for r in report.fusions]
    assert ("attention_gqa" in [r.pattern for r in report.fusions]) == (group > 1)  # repeat_kv copies only then
    exact = exact_attention(*args)
    tolerance = 1e-5 if dtype == torch.float32 else 2 * relative_error(expected, exact) + 1e-2
    assert relative_error(first_output(gm, inputs), exact) <= tolerance


def sliding_window(q, k):  # causal and at most 4 positions back: not is_causal once seq > 4
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    return (j <= i) & (i - j < 4)


def causal_pad_mask(q, k, pad):
    return causal_bool(q, k) & pad[:, None, None, :].bool()


def padded_attention(q, k, v, pad):
    return SDPA(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=causal_pad_mask(q, k, pad))


def padding_only(q, k, v, pad):  # an encoder's mask: every kept key, before and after
    return SDPA(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=pad[:, None, None, :].bool())


def hf_window(q, k, size):  # HF's sliding_window_overlay over indices: kv > q - size
    kv_idx = (torch.arange(k.shape[-2]) + 0)[None, None, None, :]
    q_idx = (torch.arange(q.shape[-2]) + 0)[None, None, :, None]
    return kv_idx > q_idx - size


def padded_window_attention(q, k, v, pad):  # Mistral's padded mask: window, causal, kept keys
    mask = hf_window(q, k, 5) & causal_bool(q, k) & pad[:, None, None, :].bool()
    return SDPA(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask)


@pytest.mark.parametrize("fn, window", [(padded_attention, None), (padded_window_attention, 5)],
                         ids=["causal", "sliding_window"])
def test_causal_padding_mask_becomes_padded_attention(fn, window):
    args = qkv(2, 8, 2, 16, 8, torch.float32)
    pad = torch.ones(2, 16)
    pad[1, 11:] = 0
    gm, inputs, expected, report, rewritten = run_pass(rewrite_attention, fn, *args, pad)
    assert [r.pattern for r in report.fusions] == ["attention_padded"] and not report.misses
    assert not sdpa_nodes(gm)
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.graphopt.padded_attention.default]
    assert fused.args[5] == window
    kept = pad.bool()[:, None, :, None]
    assert relative_error(first_output(gm, inputs) * kept, expected * kept) <= 1e-6


def unpadded_window(q, k):
    return hf_window(q, k, 5) & causal_bool(q, k)


def empty_window(q, k):  # kv > q and kv ≤ q: a window of no key
    return hf_window(q, k, 0) & causal_bool(q, k)


def upper_triangle(q, k):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu()


def only_k_repeated(q, k, v):
    return SDPA(q, repeat_kv(k, 4), v.repeat_interleave(4, dim=1), is_causal=True)


@pytest.mark.parametrize("fn, extra, reasons", [
    (hf_attention(sliding_window), (), {"attention_causal": "not the causal lower triangle",
                                        "attention_gqa": "a mask is given"}),
    (hf_attention(upper_triangle), (), {"attention_causal": "not the causal lower triangle"}),
    (hf_attention(unpadded_window), (), {"attention_causal": "a sliding window (5 tokens) over an unpadded batch"}),
    (hf_attention(empty_window), (), {"attention_causal": "not the causal lower triangle"}),
    (padding_only, (torch.ones(2, 16),), {"attention_causal": "not the causal lower triangle"}),
    (only_k_repeated, (), {"attention_gqa": "only one of key and value"}),
])
def test_unprovable_attention_stays_with_a_reason(fn, extra, reasons):
    args = qkv(2, 8, 2, 16, 8, torch.float32)
    gm, inputs, expected, report, rewritten = run_pass(rewrite_attention, fn, *args, *extra)
    misses = {r.pattern: r.reason for r in report.misses}
    assert set(reasons) <= set(misses)
    for pattern, reason in reasons.items():
        assert reason in misses[pattern]
    assert "attention_causal" not in [r.pattern for r in report.fusions]
    assert torch.equal(first_output(gm, inputs), expected)


def test_symbolic_sequence_length_causal_mask_read_symbolically():
    """HF's causal mask at a symbolic length is read as "kv ≤ q" for every length: is_causal, as at static ones."""
    from graphopt.passes.normalize import normalize
    from graphopt.plan import Plan

    graphs = []
    fn = hf_attention(causal_bool)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)
    args = qkv(2, 8, 2, 16, 8, torch.float32)
    expected = compiled(*args)
    normalize(graphs[0])
    report = Plan(graph=0)
    assert rewrite_attention(graphs[0], report) == 2
    assert [r.pattern for r in report.fusions] == ["attention_causal", "attention_gqa"] and not report.misses
    placeholders = [v for v in (n.meta.get("example_value") for n in graphs[0].graph.find_nodes(op="placeholder"))]
    assert any(isinstance(v, torch.SymInt) for v in placeholders)
    assert relative_error(graphs[0](*[a for a in _graph_inputs(graphs[0], args)])[0], expected) <= 1e-6


def _graph_inputs(gm, tensors):
    """The graph's inputs at these tensors: its symbolic sizes as the tensors' sizes, then the tensors."""
    tensors, sizes = list(tensors), {}
    values = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    for v, t in zip([v for v in values if isinstance(v, torch.Tensor)], tensors):
        for s, n in zip(v.shape, t.shape):
            sizes[str(s)] = n
    out = []
    for v in values:
        out.append(sizes[str(v)] if isinstance(v, torch.SymInt) else tensors.pop(0))
    return out


def test_sliding_window_at_a_symbolic_length_stays():
    """A mask the symbolic reading does not cover (a sliding window) cannot be evaluated at symbolic sizes: it
    stays, with the reason."""
    from graphopt.passes.normalize import normalize
    from graphopt.plan import Plan

    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(hf_attention(sliding_window), backend=lambda gm, ex: graphs.append(gm) or gm.forward,
                             dynamic=True)
    compiled(*qkv(2, 8, 2, 16, 8, torch.float32))
    normalize(graphs[0])
    report = Plan(graph=0)
    rewrite_attention(graphs[0], report)
    assert "symbolic" in {r.pattern: r.reason for r in report.misses}["attention_causal"]


@pytest.fixture
def materialized_masks(monkeypatch):
    """transformers as 5.17 runs under torch.compile: a mask tensor and repeat_kv, never is_causal."""
    import transformers.masking_utils

    monkeypatch.setattr(transformers.masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_hf_models_with_materialized_masks_train_the_same(arch, materialized_masks):
    model = tiny_lora_model(arch)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    compile_and_compare(model, ids, torch.float32)
    from graphopt.report import reports

    report = reports()[-1]
    layers = model.config.num_hidden_layers
    patterns = [r.pattern for r in report.fusions]
    assert patterns.count("attention_causal") == layers and patterns.count("attention_gqa") == layers
    assert not [r for r in report.misses if r.pattern.startswith("attention")]

