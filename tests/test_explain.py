"""`graphopt explain` (graphopt/explain.py): the model on the meta device, its training step traced for a target,
every stage deciding as it would there, nothing compiled. It lists the fusions a real training compile finds."""

import subprocess
import sys

import pytest
import torch

import graphopt
from graphopt.explain import NOTE, explain
from models import COMMON, DISTINCT, tiny_lora_model

IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))


def fusions_and_misses(plan):
    return plan.summary(), sorted((r.pattern, r.module) for r in plan.misses)


@pytest.mark.parametrize("arch", DISTINCT)
def test_explain_lists_the_fusions_training_finds(arch, fresh_dynamo):
    model = tiny_lora_model(arch)
    compiled = torch.compile(model, backend="graphopt")
    compiled(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    trained = graphopt.last_report()

    meta = tiny_lora_model(arch).to("meta")
    [plan] = explain(meta, {"input_ids": IDS.to("meta"), "labels": IDS.to("meta"), "use_cache": False}, target="cpu")
    assert fusions_and_misses(plan) == fusions_and_misses(trained)
    assert plan.saved_for_backward["estimate"]["estimated_peak_bytes"] > 0
    assert NOTE in plan.notes and plan.target == "cpu"


def test_the_command_line_explains_a_config_for_the_gpu_without_one(tmp_path):
    import transformers

    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-m", "graphopt", "explain", str(tmp_path), "--batch", "2", "--seq", "64"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target cuda" in done.stdout and "lora ×14" in done.stdout and "estimated peak of the step" in done.stdout
    assert "CUDA graphs: on" in done.stdout and NOTE in done.stdout


def test_a_gpu_target_traces_attention_as_the_gpus_kernel(monkeypatch, fresh_dynamo):
    """On the meta device SDPA takes its math form; for a GPU target it is traced as FlashAttention's kernel
    (lowering/cuda.py META_STAND_INS), which keeps its output and log-sum-exp for the backward, not the
    [B, H, L, L] weights: the estimate counts what the GPU holds."""
    from graphopt.lowering import cuda

    def saved():
        meta = tiny_lora_model("llama", dtype=torch.bfloat16).to("meta")
        ids = torch.zeros(2, 512, dtype=torch.long, device="meta")
        [plan] = explain(meta, {"input_ids": ids, "labels": ids, "use_cache": False},
                         {"memory_budget": 1}, target="cuda")
        return plan.saved_for_backward

    def has_weights(decision):
        return any(t["shape"][-2:] == [512, 512] for t in decision["largest"])

    flash = saved()
    monkeypatch.setattr(cuda, "META_STAND_INS", {})
    math = saved()
    assert has_weights(math) and not has_weights(flash)
    assert flash["estimate"]["estimated_peak_bytes"] < math["estimate"]["estimated_peak_bytes"]
