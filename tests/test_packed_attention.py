"""graphopt::packed_attention and the attention_packed rewrite (passes/attention.py): causal attention within each
document of a packed batch (padding-free, position_ids restarting per document), checked against fp64 SDPA with
HF's mask; opcheck; the rewrite of HF's mask in both forms transformers builds it (the index causal of 5.17, the
position causal of 5.24), and not of near misses; HF models on DataCollatorWithFlattening's batches at a static
then a symbolic length, loss and gradients equal to eager. On CUDA the op runs the flash variable-length kernels
(kernels/packed_attention.py), in bf16 and fp16."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, strategies as st

import graphopt  # noqa: F401  (registers the graphopt ops)
from graphs import first_output, relative_error, run_pass
from graphopt.passes.attention import rewrite_attention
from models import ARCHITECTURES, SYMBOLIC_LENGTH, tiny_lora_model
from test_attention import qkv, repeat_kv, sdpa_nodes
from test_padded_attention import WINDOWED, check, fused_attention, opcheck_layouts
from texts import VOCAB, sentences

OP = torch.ops.graphopt.packed_attention.default
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def positions_of(rows):
    """position_ids [B, L] of rows of document lengths, each row's documents one after another."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def documents(position_ids):  # HF's find_packed_sequence_indices, verbatim but for names
    diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (diff != 1).cumsum(-1)


def index_mask(q, position_ids):  # transformers 5.17 under torch.compile: causal over indices & one document
    batch, length = position_ids.shape
    doc = documents(position_ids)
    b = torch.arange(batch)[:, None, None, None]
    q_idx = (torch.arange(length) + 0)[None, None, :, None]
    kv_idx = (torch.arange(length) + 0)[None, None, None, :]
    return ((kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])).expand(batch, -1, length, length)


def position_mask(q, position_ids):  # transformers 5.24: causal over the positions & one document
    batch, length = position_ids.shape
    doc = documents(position_ids)
    positions = position_ids.expand(batch, -1)
    b = torch.arange(batch)[:, None, None, None]
    q_idx = (torch.arange(length) + 0)[None, None, :, None]
    kv_idx = (torch.arange(length) + 0)[None, None, None, :]
    causal = positions[b, kv_idx] <= positions[b, q_idx]
    return (causal & (doc[b, q_idx] == doc[b, kv_idx])).expand(batch, -1, length, length)


def position_window_mask(q, position_ids):  # transformers 5.24 under a sliding window of 3: positions compared
    batch, length = position_ids.shape
    positions = position_ids.expand(batch, -1)
    b = torch.arange(batch)[:, None, None, None]
    q_idx = (torch.arange(length) + 0)[None, None, :, None]
    kv_idx = (torch.arange(length) + 0)[None, None, None, :]
    return (positions[b, kv_idx] > positions[b, q_idx] - 3) & position_mask(q, position_ids)


def index_mask_methods(q, position_ids):  # the same, recorded as Dynamo records it in 5.17: call_method __eq__
    batch, length = position_ids.shape
    doc = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1).__ne__(1).cumsum(-1)
    b = torch.arange(batch)[:, None, None, None]
    q_idx = (torch.arange(length) + 0)[None, None, :, None]
    kv_idx = (torch.arange(length) + 0)[None, None, None, :]
    return kv_idx.__le__(q_idx).__and__(doc[b, q_idx].__eq__(doc[b, kv_idx])).expand(batch, -1, length, length)


def exact(q, k, v, position_ids, scale, window=None):
    """fp64 SDPA with HF's mask (within the sliding window, over positions, if any)."""
    groups = q.shape[1] // k.shape[1]
    mask = index_mask(q, position_ids.cpu()).to(q.device)
    if window is not None:
        mask = mask & (position_ids[:, None, None, :] > position_ids[:, None, :, None] - window)
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(groups, 1),
                                          v.double().repeat_interleave(groups, 1), attn_mask=mask, scale=scale)


def inputs(batch, heads, kv_heads, length, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, h, dim, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]  # as HF lays them out: [B, L, H, D] seen as [B, H, L, D]


@pytest.mark.parametrize("device", DEVICES)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.sampled_from([1, 2, 4]),
       dim=st.sampled_from([8, 16, 64]), data=st.data())
def test_matches_fp64(device, batch, kv_heads, groups, dim, data):
    length = data.draw(st.integers(1, 48))
    rows = []
    for _ in range(batch):  # each row: documents of 1 or more tokens filling the length
        cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=6)) if length > 1 else [])
        rows.append([b - a for a, b in zip([0] + cuts, cuts + [length])])
    position_ids = positions_of(rows).to(device)
    window = data.draw(st.none() | st.integers(1, length + 1))
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    for dtype in dtypes:
        q, k, v = inputs(batch, kv_heads * groups, kv_heads, length, dim, dtype, device, seed=length)
        check(q, k, v, position_ids, dim ** -0.5, 1e-5 if dtype == torch.float32 else 2e-2, OP, exact, window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch, window", [(1, None), (2, None), (2, 5)])
def test_opcheck(device, batch, window):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CUDA: the flash kernels
    q, k, v = inputs(batch, 4, 2, 24, 64, dtype, device)
    position_ids = positions_of([[4, 11, 9], [24]][:batch]).to(device)
    opcheck_layouts(OP, torch.ops.graphopt.packed_attention_backward.default, q, k, v, position_ids, 0.125, window)


def test_documents_are_runs_of_consecutive_positions():
    """A document starts at a row's start and wherever a position is not the last plus 1 (a restart at 0, or a
    jump), as HF numbers them."""
    from graphopt.kernels.reference import document_starts

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 0], [3, 4, 5, 6, 7, 8, 9, 10]])
    starts = document_starts(position_ids)
    assert starts.int().tolist() == [[1, 0, 0, 1, 0, 1, 0, 1], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert torch.equal(starts.cumsum(-1) - 1, documents(position_ids) - documents(position_ids)[:, :1])


def test_once_per_tensor_reuses_only_the_same_unchanged_tensor():
    """The documents are found once for the position_ids every layer reads: again for another tensor (equal or
    not), after an in-place write, and at every call of an inference tensor (which counts no versions)."""
    from graphopt.kernels.layout import once_per_tensor

    calls = []
    derive = once_per_tensor(lambda t: calls.append(t.tolist()) or t.sum().item())
    first = torch.tensor([0, 1, 2])
    assert [derive(first), derive(first)] == [3, 3] and len(calls) == 1
    assert derive(first.clone()) == 3 and len(calls) == 2
    first.add_(1)
    assert derive(first) == 6 and len(calls) == 3
    with torch.inference_mode():
        frozen = torch.tensor([1, 1])
        assert [derive(frozen), derive(frozen)] == [2, 2] and len(calls) == 5


def test_once_per_tensor_derives_at_every_call_while_a_cuda_graph_is_captured(monkeypatch):
    """A capture holds its own derivation and keeps none: a CUDA graph's output comes back as the same tensor at
    every replay, its contents new and its version the same, so a result kept from a capture would be another
    batch's. After the capture, the result kept before it is the one reused."""
    from graphopt.kernels import layout

    calls = []
    derive = layout.once_per_tensor(lambda t: calls.append(t.tolist()) or t.sum().item())
    before, captured = torch.tensor([0, 1, 2]), torch.tensor([5, 5])
    assert derive(before) == 3 and len(calls) == 1
    monkeypatch.setattr(layout, "capturing", lambda: True)
    assert [derive(captured), derive(captured), derive(before)] == [10, 10, 3] and len(calls) == 4
    monkeypatch.setattr(layout, "capturing", lambda: False)
    assert derive(before) == 3 and len(calls) == 4
    assert derive(captured) == 10 and len(calls) == 5


@pytest.mark.skipif("cuda" not in DEVICES, reason="the flash kernels run on CUDA")
def test_cuda_runs_the_flash_kernels():
    """bf16 on CUDA takes the variable-length flash kernels (no [L × L] scores)."""
    from graphopt.kernels import padded_attention

    q, k, v = inputs(1, 8, 2, 512, 64, torch.bfloat16, "cuda")
    assert padded_attention.supported(q, k, v)
    position_ids = positions_of([[100, 300, 112]]).cuda()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    OP(q, k, v, position_ids, 0.125)
    scores = 8 * 512 * 512 * 4
    assert torch.cuda.max_memory_allocated() - before < scores


def hf_packed(mask_of):
    def attention(q, k, v, position_ids):
        n = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask_of(q, position_ids))
    return attention


@pytest.mark.parametrize("mask_of, window", [(index_mask, None), (index_mask_methods, None), (position_mask, None),
                                             (position_window_mask, 3)])
def test_both_forms_of_hf_packed_mask_become_packed_attention(mask_of, window):
    q, k, v = qkv(2, 8, 2, 16, 8, torch.float32)
    position_ids = positions_of([[5, 7, 4], [16]])
    gm, inputs_, expected, report, _ = run_pass(rewrite_attention, hf_packed(mask_of), q, k, v, position_ids)
    assert [r.pattern for r in report.fusions] == ["attention_packed"] and not report.misses
    assert not sdpa_nodes(gm)
    (fused,) = [n for n in gm.graph.nodes if n.target is OP]
    assert fused.args[5] == window
    assert relative_error(first_output(gm, inputs_), expected) <= 1e-6


def positions_only(q, position_ids):  # causal over positions without the documents: not causal over indices
    batch, length = position_ids.shape
    b = torch.arange(batch)[:, None, None, None]
    q_idx, kv_idx = torch.arange(length)[None, None, :, None], torch.arange(length)[None, None, None, :]
    return position_ids[b, kv_idx] <= position_ids[b, q_idx]


def other_documents(q, position_ids):  # documents broken where positions step by 2: not HF's numbering
    batch, length = position_ids.shape
    doc = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 2).cumsum(-1)
    b = torch.arange(batch)[:, None, None, None]
    q_idx, kv_idx = torch.arange(length)[None, None, :, None], torch.arange(length)[None, None, None, :]
    return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])


@pytest.mark.parametrize("mask_of", [positions_only, other_documents])
def test_near_misses_stay(mask_of):
    q, k, v = qkv(2, 8, 2, 16, 8, torch.float32)
    position_ids = positions_of([[5, 7, 4], [16]])
    gm, inputs_, expected, report, _ = run_pass(rewrite_attention, hf_packed(mask_of), q, k, v, position_ids)
    assert "attention_packed" not in [r.pattern for r in report.fusions]
    assert [m for m in report.misses if m.pattern == "attention_causal"]
    assert torch.equal(first_output(gm, inputs_), expected)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_hf_packed_batches_fuse_and_train_the_same(arch, fresh_dynamo):
    """DataCollatorWithFlattening's batches at a static length, then (SYMBOLIC_LENGTH) a symbolic one: every
    attention layer fused (but under a sliding window, which stays with a miss), loss and gradients equal to eager."""
    # HF keeps documents apart without a cache
    model = tiny_lora_model(arch, vocab_size=VOCAB, use_cache=False, **WINDOWED.get(arch, {}))
    data = sentences()
    flatten = transformers.DataCollatorWithFlattening()
    batches = [flatten(data[0:4]), flatten(data[6:9])][:2 if arch in SYMBOLIC_LENGTH else 1]
    fused_attention(model, batches, "attention_packed")


def test_gemma3_sliding_window_layers_fuse_with_the_documents(fresh_dynamo):
    """Both layer kinds fused, the sliding window counted over positions within each document."""
    model = tiny_lora_model("gemma3", vocab_size=VOCAB, use_cache=False)
    fused_attention(model, [transformers.DataCollatorWithFlattening()(sentences()[0:4])], "attention_packed")


@pytest.mark.skipif("cuda" not in DEVICES, reason="the flash kernels run on CUDA")
def test_documents_found_once_a_batch(monkeypatch, fresh_dynamo):
    """Every layer's forward and backward reads the same position_ids: the documents are found, and the GPU waited
    for, once a batch rather than once a layer."""
    from graphopt.kernels import packed_attention

    found = []
    starts = packed_attention.document_starts
    monkeypatch.setattr(packed_attention, "document_starts", lambda p: found.append(1) or starts(p))
    model = tiny_lora_model("llama", vocab_size=VOCAB, use_cache=False).to("cuda", torch.bfloat16)
    compiled = torch.compile(model, backend="graphopt")
    flatten = transformers.DataCollatorWithFlattening()
    for rows in (sentences()[0:4], sentences()[4:8]):
        batch = {k: v.cuda() for k, v in flatten(rows).items()}
        compiled(**batch).loss.backward()
    assert graphopt.last_report().summary().get("attention_packed") == model.config.num_hidden_layers
    assert len(found) == 2
