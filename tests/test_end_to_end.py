"""Tiny HF models with PEFT LoRA through torch.compile(backend="graphopt"): loss and every LoRA gradient equal
eager, and the report shows one RMSNorm fusion per RMSNorm module. Runs on CPU in CI and on CUDA (Triton
lowering, fp32 and bf16) where a GPU is present."""

import pytest
import torch

import graphopt
from graphs import relative_error
from models import ARCHITECTURES, adapted_layers, rms_norm_modules, tiny_lora_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = [(d, torch.float32) for d in DEVICES] + [("cuda", torch.bfloat16)] * torch.cuda.is_available()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()  # a compiled model shares the eager params
    grads = {name: p.grad.detach().clone() for name, p in params if p.requires_grad}
    return loss.detach(), grads


def compile_and_compare(model, ids, dtype, **compile_kwargs):
    """Compiled vs eager: in fp32 both against each other (≤1e-5); in bf16 both against an fp64 eager run,
    where the compiled error may not exceed eager's own by more than rounding noise."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", **compile_kwargs)
    loss, grads = loss_and_grads(compiled, ids)
    eager_loss, eager_grads = loss_and_grads(model, ids)
    assert set(grads) == set(eager_grads) and all(g.abs().sum() > 0 for g in grads.values())
    if dtype == torch.float32:
        assert relative_error(loss, eager_loss) <= 1e-5
        for name in grads:
            assert relative_error(grads[name], eager_grads[name]) <= 1e-5, name
    else:
        exact_loss, exact_grads = loss_and_grads(model.to(torch.float64), ids)
        model.to(dtype)
        assert relative_error(loss, exact_loss) <= 2 * relative_error(eager_loss, exact_loss) + 1e-3
        for name in grads:
            bound = 2 * relative_error(eager_grads[name], exact_grads[name]) + 1e-2
            assert relative_error(grads[name], exact_grads[name]) <= bound, name
    return graphopt.last_report()


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_lora_model_matches_eager(arch, device, dtype):
    model = tiny_lora_model(arch, dtype).to(device)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    report = compile_and_compare(model, ids, dtype)
    gated = "geglu" if arch == "gemma" else "swiglu"
    # norms: 2 per layer + final; one rope (q and k together) per attention layer; every adapted linear (7 per
    # layer, 4 in Phi-3's fused qkv and gate_up); the lm_head + loss
    summary = report.summary()
    # attention is rewritten only where transformers builds the causal mask and repeats k/v itself (5.17 under
    # torch 2.11, the GPU machine's; 5.24 calls SDPA's is_causal and enable_gqa): then once per layer
    attention = {pattern: summary.pop(pattern) for pattern in list(summary) if pattern.startswith("attention_")}
    assert all(count == 2 for count in attention.values()), attention
    assert summary == {"rms_norm": rms_norm_modules(model), "rope": 2, gated: 2,
                       "lora": len(adapted_layers(model)), "linear_cross_entropy": 1}
    assert rms_norm_modules(model) == 5
    assert report.misses == []
    assert report.target == device
    assert {r.op for r in report.lowering} == {f"graphopt.{op}.default" for op in (
        "rms_norm", "rms_norm_backward", "rope", "rope_backward", "gated_activation", "gated_activation_backward",
        "lora_down", "lora_linear", "lora_linear_backward", "linear_cross_entropy", "linear_cross_entropy_backward")}
    if device == "cuda":
        assert all("Triton" in r.implementation for r in report.lowering)


class OddRMSNorm(torch.nn.Module):
    """Named like an RMSNorm but with eps outside the root: a different function the pass must not fuse."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return self.weight * x / (x.norm(dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + 1e-6)


def test_unrecognised_norm_trains_correctly_and_is_reported():
    model = tiny_lora_model("llama")
    inner = model.base_model.model.model
    for layer in inner.layers:
        layer.input_layernorm = OddRMSNorm(64)
    report = compile_and_compare(model, torch.randint(0, 128, (2, 16)), torch.float32)
    odd = {f"base_model.model.model.layers.{i}.input_layernorm" for i in range(2)}
    assert {r.module for r in report.misses} == odd
    assert all("does not recognise" in r.reason for r in report.misses)
    assert report.summary()["rms_norm"] == 3  # post-attention norms and the final norm still fuse

    # and it trains: a few AdamW steps, compiled and eager in lockstep
    torch._dynamo.reset()
    twin = tiny_lora_model("llama")
    for layer in twin.base_model.model.model.layers:
        layer.input_layernorm = OddRMSNorm(64)
    compiled = torch.compile(twin, backend="graphopt")
    model.zero_grad(set_to_none=True)
    models = (model, compiled)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, twin)]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        losses = []
        for m, opt in zip(models, optimizers):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
    assert losses[0] < 4.85  # it learned something from ln(128) ≈ 4.85


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic=True"])
def test_dynamic_shapes_compile_once(dynamic, tmp_path):
    """Automatic dynamic shapes (torch.compile's default, what HF's Trainer gets): the first change of size
    recompiles once with symbolic batch and sequence; later sizes reuse that graph; everything fuses.
    dynamic=True from the start: one graph for every size, and one report for it (Dynamo restarts its first
    analysis to pass float attributes as tensors: the abandoned graph leaves no report and no file). The LoRA
    scaling is then a float the graph reads at each call: still fused, and a changed scaling is used."""
    model = tiny_lora_model("llama")
    torch._dynamo.reset()
    before = len(graphopt.reports())
    report_path = tmp_path / "report.json"
    compiled = torch.compile(model, backend="graphopt", dynamic=dynamic, options={"report": str(report_path)})
    compiled_after = []
    for step, (batch, seq) in enumerate([(2, 16), (3, 24), (4, 9)]):  # sizes ≥ 2: Dynamo specializes 0 and 1
        ids = torch.randint(0, 128, (batch, seq))
        loss, grads = loss_and_grads(compiled, ids)
        eager_loss, eager_grads = loss_and_grads(model, ids)
        assert relative_error(loss, eager_loss) <= 1e-5
        assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in grads)
        compiled_after.append(len(graphopt.reports()) - before)
    if dynamic is None:
        assert compiled_after == [1, 2, 2]  # one recompile, then reuse
    else:
        assert compiled_after == [1, 1, 1]  # one graph, one report
        assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    report = graphopt.last_report()
    assert report.summary() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "lora": 14, "linear_cross_entropy": 1}
    assert report.misses == []
    assert any(isinstance(s, str) for s in report.fusions[0].shape)  # symbolic batch/sequence sizes
    assert isinstance(report.saved_for_backward["bytes"], str)  # a size expression, not one shape's number
    # the peak estimate too: a polynomial in the batch and sequence symbols, e.g. "4636*s27*s52 + 128*s27 + 466208"
    batch_symbol = report.fusions[0].shape[0]
    assert batch_symbol in report.saved_for_backward["estimate"]["estimated_peak_bytes"]
    if dynamic:
        for module in model.modules():
            if isinstance(getattr(module, "scaling", None), dict):
                module.scaling["default"] = 0.5
        ids = torch.randint(0, 128, (2, 16))
        loss, grads = loss_and_grads(compiled, ids)
        eager_loss, eager_grads = loss_and_grads(model, ids)
        assert relative_error(loss, eager_loss) <= 1e-5
        assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in grads)


def test_gradient_checkpointing_keeps_the_fusions_and_becomes_the_memory_plan():
    """HF gradient checkpointing (use_reentrant=False, TrainingArguments(gradient_checkpointing=True)): the
    checkpointed layers are inlined and fused as without it, and the memory plan recomputes each layer instead."""
    model = tiny_lora_model("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    before = len(graphopt.reports())
    compile_and_compare(model, torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3)),
                        torch.float32)
    reports = graphopt.reports()[before:]
    total = {}
    for report in reports:
        for pattern, count in report.summary().items():
            total[pattern] = total.get(pattern, 0) + count
    attention = {p: total.pop(p) for p in list(total) if p.startswith("attention_")}
    assert all(count == 2 for count in attention.values()), attention
    assert total == {"rms_norm": 5, "rope": 2, "swiglu": 2, "lora": 14, "linear_cross_entropy": 1}
    assert not any(r.misses for r in reports)
    layers = next(r for r in reports if r.summary().get("lora"))
    assert any("gradient checkpointing: 2 checkpointed regions" in note for note in layers.notes)
    assert layers.saved_for_backward["memory_budget"] == 0


def test_report_option_writes_every_format(tmp_path):
    model = tiny_lora_model("qwen2")
    ids = torch.randint(0, 128, (2, 8))
    for suffix in (".txt", ".json", ".html"):
        torch._dynamo.reset()
        path = tmp_path / f"report{suffix}"
        compiled = torch.compile(model, backend="graphopt", options={"report": str(path)})
        compiled(input_ids=ids, labels=ids).loss.backward()  # written once the graph compiled, memory plan in it
        text = path.read_text()
        assert "base_model.model.model.layers.1" in text
        assert ("estimated_peak_bytes" if suffix == ".json" else "estimated peak of the step") in text
    import json

    data = json.loads((tmp_path / "report.json").read_text())
    assert len(data["fusions"]) == 10 + len(adapted_layers(model)) and data["misses"] == []
    assert data["saved_for_backward"]["tensors"] > 0 and data["saved_for_backward"]["bytes"] > 0


@pytest.mark.parametrize("offload", [False, True])
def test_mps_target_runs_the_references_eagerly(offload, monkeypatch):
    """On a Mac the graph runs eagerly with every op's pure-torch reference, and says so in the report; offload
    is planned, not copied (MPS memory is the host's). Faked here on CPU tensors: the target is what differs."""
    import graphopt.pipeline

    monkeypatch.setattr(graphopt.pipeline, "resolve_target", lambda requested, inputs: "mps")
    model = tiny_lora_model("llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    report = compile_and_compare(model, ids, torch.float32, options={"memory_budget": 0, "offload": offload})
    assert report.target == "mps"
    assert report.lowering and all("pure-torch reference" in r.implementation for r in report.lowering)
    assert all("Apple MPS" in r.note for r in report.lowering if r.note and "backward graph" not in r.note)
    if offload:
        assert report.saved_for_backward["offload"]["copies_made"] is False
