"""Compiles reused across processes: Inductor's FX graph cache serves graphopt's forward and backward graphs when
graphopt's code and the partitioned graph match (passes/recompute.py Partitioner.uuid,
lowering/registry.py InductorDecompositions, graphopt/fingerprint.py). Within one process after
torch._dynamo.reset(), the cache is read from disk as a second process reads it."""

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import graphopt
from graphopt.passes import recompute
from models import tiny_lora_model


def compile_step(model, ids, options):
    torch._dynamo.reset()
    counters.clear()
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, backend="graphopt", options=options)(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return loss.detach(), grads, dict(counters["inductor"])


def test_a_second_compile_is_served_by_the_fx_graph_cache(monkeypatch):
    """The same model and settings: both graphs come from the cache, with the same numbers, and the report still
    shows the memory plan (the partitioner runs; AOTAutograd's cache, which would skip it, stays off). Other
    settings, or another graphopt's code, compile afresh."""
    model = tiny_lora_model("llama", num_hidden_layers=1)  # one decoder layer: the four compiles are the test's time
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True):  # off for the rest of the suite
        loss, grads, first = compile_step(model, ids, {})
        assert first.get("fxgraph_cache_miss") == 2 and not first.get("fxgraph_cache_bypass"), first
        again_loss, again_grads, again = compile_step(model, ids, {})
        assert again.get("fxgraph_cache_hit") == 2 and not again.get("fxgraph_cache_miss"), again
        assert torch.equal(again_loss, loss) and all(torch.equal(a, b) for a, b in zip(again_grads, grads))
        assert graphopt.last_report().saved_for_backward["memory_budget"] == 1.0
        assert compile_step(model, ids, {"memory_budget": 0})[2].get("fxgraph_cache_miss") == 2
        monkeypatch.setattr(recompute, "code_fingerprint", lambda: "another graphopt")
        assert compile_step(model, ids, {})[2].get("fxgraph_cache_miss") == 2
