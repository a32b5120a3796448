"""Batches as SFT makes them: padded per batch to their own length, or packed without padding
(DataCollatorWithFlattening: one row, position_ids restarting at each document). Equal to eager, every fusion
found (RoPE at per-document positions), a bounded number of compiles: the first size static, the next one
dynamic, which every later size reuses."""

import torch
import transformers

import graphopt
from graphs import relative_error
from models import tiny_lora_model
from texts import VOCAB, pad_batch, sentences

EXPECTED = {"rms_norm": 5, "rope": 2, "swiglu": 2, "lora": 14, "linear_cross_entropy": 1}


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in params if p.requires_grad}


def compile_and_compare(model, batches):
    """Each batch through the compiled and the eager model; the number of graphs compiled after each."""
    torch._dynamo.reset()
    before = len(graphopt.reports())
    compiled = torch.compile(model, backend="graphopt")
    graphs = []
    for batch in batches:
        loss, grads = loss_and_grads(compiled, batch)
        eager_loss, eager_grads = loss_and_grads(model, batch)
        assert relative_error(loss, eager_loss) <= 1e-5
        assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in grads)
        graphs.append(len(graphopt.reports()) - before)
    return graphs, graphopt.reports()[before:]


def fused(report):
    return {p: n for p, n in report.summary().items() if not p.startswith("attention_")}


def test_padded_batches_of_varying_length():
    data = sentences()
    batches = [pad_batch(rows) for rows in (data[0:4], data[7:9], data[8:12], data[12:14])]
    assert len({b["input_ids"].shape[1] for b in batches}) == 4
    assert len({len(b["input_ids"]) for b in batches}) == 2
    graphs, reports = compile_and_compare(tiny_lora_model("llama", vocab_size=VOCAB), batches)
    assert graphs == [1, 2, 2, 2]
    assert all(fused(r) == EXPECTED for r in reports)
    assert [any(n.startswith("dynamic shapes") for n in r.notes) for r in reports] == [False, True]


def test_packed_batches_with_per_document_positions():
    """HF keeps documents apart only without a KV cache (use_cache=False, as TRL's padding-free training and
    gradient checkpointing set it): then the packed loss is the documents' own, compiled as in eager."""
    data = sentences()
    flatten = transformers.DataCollatorWithFlattening()
    batches = [flatten(data[i:i + 4]) for i in (0, 4, 8)]
    assert all(b["input_ids"].shape[0] == 1 and "position_ids" in b for b in batches)
    model = tiny_lora_model("llama", vocab_size=VOCAB, use_cache=False)
    graphs, reports = compile_and_compare(model, batches)
    assert graphs == [1, 2, 2]
    assert all(fused(r) == EXPECTED for r in reports)
    # no attention across documents: the packed loss is the token-weighted mean of each document's own
    with torch.no_grad():
        packed = model(**batches[0]).loss
        losses, tokens = zip(*((model(input_ids=ids, labels=ids).loss, ids.shape[1] - 1)
                               for ids in (torch.tensor([row["input_ids"]]) for row in data[0:4])))
    assert relative_error(packed, sum(l * t for l, t in zip(losses, tokens)) / sum(tokens)) <= 1e-5
    # the per-document mask, read from position_ids, becomes packed_attention in both graphs
    assert all(r.summary().get("attention_packed") == 2 for r in reports)
    assert not [m for r in reports for m in r.misses if m.pattern.startswith("attention")]
