"""memory_budget (passes/recompute.py): every budget computes what eager computes, a smaller budget never saves
more, the report's saved_for_backward is what autograd holds, and the knapsack's cost model prices graphopt ops
by their matmuls."""

import peft
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import graphopt
from graphs import relative_error
from models import tiny_lora_model
from test_lora import compiled_step_saves

BUDGETS = [1, 0.3, 0]


def loss_grads_and_saved(model, ids, memory_budget):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options={"memory_budget": memory_budget})
    model.zero_grad(set_to_none=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, graphopt.last_report().saved_for_backward


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_every_budget_matches_eager_and_a_smaller_one_saves_less(arch):
    model = tiny_lora_model(arch)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    eager_loss = model(input_ids=ids, labels=ids).loss
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    saved = []
    for budget in BUDGETS:
        loss, grads, report = loss_grads_and_saved(model, ids, budget)
        assert relative_error(loss, eager_loss) <= 1e-5, budget
        assert grads.keys() == eager_grads.keys()
        assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in grads), budget
        assert report["memory_budget"] == budget
        assert sum(layer["saved_bytes"] for layer in report["per_layer"].values()) == report["bytes"]
        assert sum(layer["recomputed_bytes"] for layer in report["per_layer"].values()) == report["recomputed"]["bytes"]
        assert {f"base_model.model.model.layers.{i}" for i in range(2)} <= report["per_layer"].keys()
        saved.append(report)
    assert saved[0]["bytes"] > saved[1]["bytes"] > saved[2]["bytes"] == 0  # budget 0 keeps only the graph's inputs
    recomputed = [report["recomputed"] for report in saved]
    assert recomputed[0]["bytes"] < recomputed[1]["bytes"] < recomputed[2]["bytes"]
    # budget 0 recomputes the whole forward: at least every adapted base matmul
    base_matmuls = sum(2 * ids.numel() * m.base_layer.weight.numel() for m in model.modules()
                       if isinstance(m, peft.tuners.lora.LoraLayer))
    assert recomputed[2]["flops"] >= base_matmuls > recomputed[0]["flops"]


def test_report_at_a_budget_counts_what_autograd_holds():
    held, _, saved = compiled_step_saves({"memory_budget": 0.3})
    assert saved["memory_budget"] == 0.3
    assert saved["tensors"] + saved["inputs_kept"] == len(held)
    assert saved["bytes"] + saved["inputs_kept_bytes"] == sum(t.numel() * t.element_size() for t in held)
    assert "saved for backward (memory_budget 0.3): " in graphopt.last_report().to_text()


def flops(fn, *args):
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def test_cost_model_prices_fused_ops_by_their_matmuls():
    """The knapsack recomputes what costs least: the fused LoRA linear and loss cost their matmuls (as the unfused
    aten matmuls would), the memory-bound ops nothing, like the pointwise aten ops around them."""
    tokens, hidden, out, rank, vocab = 6, 16, 24, 4, 40
    x, weight = torch.randn(2, 3, hidden), torch.randn(out, hidden)
    lora_a, lora_b = torch.randn(rank, hidden), torch.randn(out, rank)
    assert flops(torch.ops.graphopt.lora_linear, x, weight, None, lora_a, lora_b, 2.0, torch.float32) == (
        2 * tokens * out * hidden + 2 * tokens * rank * (hidden + out))
    h, lm_head, target = torch.randn(tokens, hidden), torch.randn(vocab, hidden), torch.randint(0, vocab, (tokens,))
    for grad_hidden, grad_weight, products in [(True, False, 2), (True, True, 3), (False, False, 1)]:
        assert flops(torch.ops.graphopt.linear_cross_entropy, h, lm_head, None, target, -100, "mean", 0.0, 4,
                     grad_hidden, grad_weight) == products * 2 * tokens * vocab * hidden
    assert flops(torch.ops.graphopt.rms_norm, x, torch.ones(hidden), 1e-6, 0.0, torch.float32) == 0
