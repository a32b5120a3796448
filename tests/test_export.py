"""Deployment export (graphopt/export.py, graphopt/export_onnx.py): the fused model as a torch.export program that
graphopt.load runs as eager does, as ONNX (com.graphopt ops, or standard ops run by onnxruntime) and as MLIR
through torch-mlir; what an export cannot take is refused before any file is written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt.export import ExportError
from models import ARCHITECTURES, COMMON, adapted_layers, rms_norm_modules, tiny_lora_model

TESTS = Path(__file__).parent
GENERATOR = torch.Generator().manual_seed(0)


def batch(size, length, padded=True):
    """input_ids and attention_mask of random tokens; with padded, the second row's first 2 tokens are padding."""
    ids = torch.randint(1, COMMON["vocab_size"], (size, length), generator=GENERATOR)
    mask = torch.ones(size, length, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def eager_logits(model, inputs):
    with torch.no_grad():
        return model.eval()(**inputs, use_cache=False).logits


def relative_error(out, ref, mask):
    """‖out − ref‖ / ‖ref‖ over the kept positions: at a padding query the fused attention gives 0 where eager
    attends the row's tokens, a value no kept position reads (docs/architecture.md)."""
    keep = mask.bool()
    return ((torch.as_tensor(out)[keep] - ref[keep]).norm() / ref[keep].norm()).item()


# --- "torch": torch.export, read back by graphopt.load -----------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_torch_export_runs_as_eager_at_any_batch_and_length(arch, tmp_path):
    model = tiny_lora_model(arch)
    model.train()
    graphopt.export(model, batch(2, 16), tmp_path)
    assert model.training, "the model's mode comes back"

    program = graphopt.load(tmp_path)
    for size, length in ((2, 16), (3, 9)):
        inputs = batch(size, length)
        with torch.no_grad():
            out = program(**inputs)
        assert list(out) == ["logits"]
        assert relative_error(out["logits"], eager_logits(model, inputs), inputs["attention_mask"]) <= 1e-5

    # the fusions a training compile finds, as graphopt ops in the program
    plan = graphopt.last_report()
    summary = plan.summary()
    assert summary["rms_norm"] == rms_norm_modules(model)
    assert summary["lora"] == len(adapted_layers(model))
    if arch != "mistral":  # Mistral's sliding-window mask is not causal attention: never fused
        assert summary["attention_padded"] == COMMON["num_hidden_layers"]
    described = json.loads((tmp_path / "export.json").read_text())
    assert described["graphopt_ops"]["graphopt.lora_linear.default"] == summary["lora"]
    assert described["outputs"] == ["logits"] and described["format"] == "torch"
    assert (tmp_path / "report.txt").read_text().startswith("graphopt report")


def test_the_export_fuses_what_a_training_compile_fuses(tmp_path):
    """The same nodes fused as under torch.compile(backend="graphopt", dynamic=True), node key for node key."""
    from graphopt.options import parse_options
    from graphopt.passes.registry import FUSIONS
    from graphopt.pipeline import compile_graph

    model = tiny_lora_model("llama", num_hidden_layers=1).eval()
    inputs = batch(2, 16)
    options = parse_options({}, FUSIONS)
    torch._dynamo.reset()
    with torch.no_grad():  # every stage decides as it would, and the graph runs as traced (graphopt explain's way)
        torch.compile(model, dynamic=True, backend=lambda gm, args: compile_graph(gm, args, options, explain=True))(
            **inputs, use_cache=False)
    torch._dynamo.reset()
    compiled = graphopt.last_report()
    graphopt.export(model, inputs, tmp_path)
    exported = graphopt.last_report()
    assert [(r.pattern, r.key) for r in exported.fusions] == [(r.pattern, r.key) for r in compiled.fusions]
    assert exported.summary() == {"attention_padded": 1, "rms_norm": 3, "rope": 1, "swiglu": 1, "lora": 7}
    assert not exported.misses


def test_merged_and_decomposed_the_program_holds_standard_ops_only(tmp_path):
    """merge_lora: PEFT's merge on a copy (the model keeps its adapters); decompose: every graphopt op replaced by
    its reference, so the program runs without graphopt."""
    model = tiny_lora_model("gemma")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    graphopt.export(model, batch(2, 16), tmp_path, merge_lora=True, decompose=True)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert "lora" not in graphopt.last_report().summary()
    program = torch.export.load(tmp_path / "model.pt2")
    assert not [n for n in program.graph.nodes if "graphopt" in str(n.target)]
    inputs = batch(3, 12)
    with torch.no_grad():
        out = program.module()(**inputs)["logits"]
    assert relative_error(out, eager_logits(model, inputs), inputs["attention_mask"]) <= 1e-5


# --- refusals: before any file is written --------------------------------------------------------------------

@pytest.mark.parametrize("inputs, kwargs, message", [
    ({"labels": True}, {}, "holds labels: the model would compute its training loss"),
    ({}, {"options": {"offload": True}}, r"option offload= decides a training step.*leave offload out"),
    ({}, {"options": {"plan": "somewhere"}}, "leave plan out"),
    ({"use_cache": True}, {}, "use_cache=True"),
    ({}, {"format": "gguf"}, "format='gguf' is not one of"),
    ({}, {"format": "mlir", "mlir_output": "spirv"}, "mlir_output='spirv' is not one of"),
    ({"batch_of_one": True}, {}, "batch and sequence sizes must be at least 2"),
])
def test_what_the_export_cannot_take_is_refused_first(inputs, kwargs, message, tmp_path):
    example = batch(1, 8, padded=False) if inputs.pop("batch_of_one", False) else batch(2, 8)
    if inputs.pop("labels", False):
        example["labels"] = example["input_ids"]
    example.update(inputs)
    with pytest.raises(ExportError, match=message):
        graphopt.export(tiny_lora_model("llama"), example, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_directory_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files and no export"):
        graphopt.export(tiny_lora_model("llama"), batch(2, 8), tmp_path)


def test_load_reads_torch_exports_only(tmp_path):
    with pytest.raises(ExportError, match="not a directory graphopt.export wrote"):
        graphopt.load(tmp_path)
    (tmp_path / "export.json").write_text(json.dumps({"schema": "graphopt.export/1", "format": "onnx",
                                                      "file": "model.onnx"}))
    with pytest.raises(ExportError, match="graphopt.load reads \"torch\" exports"):
        graphopt.load(tmp_path)


# --- the command line ---------------------------------------------------------------------------------------

def test_the_command_line_exports(tmp_path):
    done = subprocess.run([sys.executable, "-m", "graphopt", "optimize", "models:tiny_llama", "--out",
                           str(tmp_path / "out"), "--batch", "2", "--seq", "8", "--dtype", "fp32", "--device", "cpu",
                           "--export", "torch", "--merge-lora"], capture_output=True, text=True, timeout=300,
                          cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch export written to" in done.stdout and "graphopt.load(" in done.stdout
    described = json.loads((tmp_path / "out" / "export.json").read_text())
    assert described["merge_lora"] and described["inputs"]["input_ids"].startswith("int64[2, 8]")
