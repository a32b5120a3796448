"""Deployment export (graphopt/export.py, graphopt/export_onnx.py): the fused model as a torch.export program that
graphopt.load runs as eager does, as ONNX (com.graphopt ops, or standard ops run by onnxruntime) and as MLIR
through torch-mlir; what an export cannot take is refused before any file is written."""

import collections
import importlib.util
import json
import sys

import pytest
import torch

import graphopt
from graphopt.export import ExportError
from models import ARCHITECTURES, COMMON, adapted_layers, rms_norm_modules, tiny_lora_model

GENERATOR = torch.Generator().manual_seed(0)


def batch(size, length, padded=True):
    """input_ids and attention_mask of random tokens; with padded, the second row's first 2 tokens are padding."""
    ids = torch.randint(1, COMMON["vocab_size"], (size, length), generator=GENERATOR)
    mask = torch.ones(size, length, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def packed(size, length):
    """input_ids and position_ids of two documents a row (positions restarting at 0 halfway)."""
    positions = torch.cat([torch.arange(length // 2), torch.arange(length - length // 2)])
    return {"input_ids": torch.randint(1, COMMON["vocab_size"], (size, length), generator=GENERATOR),
            "position_ids": positions.expand(size, length).contiguous()}


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
    assert summary["attention_padded"] == COMMON["num_hidden_layers"]
    described = json.loads((tmp_path / "export.json").read_text())
    assert (described["graphopt_ops"]["graphopt.lora_linear.default"] == summary["lora"]
            == described["graphopt_ops"]["graphopt.lora_down.default"])
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
    its reference, so the program runs without graphopt. A packed batch: documents apart, as HF keeps them."""
    model = tiny_lora_model("gemma")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    graphopt.export(model, packed(2, 16), tmp_path, merge_lora=True, decompose=True)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    summary = graphopt.last_report().summary()
    assert "lora" not in summary and summary["attention_packed"] == COMMON["num_hidden_layers"]
    program = torch.export.load(tmp_path / "model.pt2")
    assert not [n for n in program.graph.nodes if "graphopt" in str(n.target)]
    inputs = packed(3, 12)
    with torch.no_grad():
        out = program.module()(**inputs)["logits"]
    assert relative_error(out, eager_logits(model, inputs), torch.ones(3, 12)) <= 1e-5


# --- "onnx" -------------------------------------------------------------------------------------------------

def _missing(*packages) -> list:
    return [name for name in packages if importlib.util.find_spec(name) is None]


needs_onnx = pytest.mark.skipif(bool(_missing("onnx", "onnxscript", "onnxruntime")),
                                reason=f"not installed: {_missing('onnx', 'onnxscript', 'onnxruntime')}")


def graphopt_nodes(model_proto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model_proto.graph.node if n.domain == "com.graphopt")


@needs_onnx
@pytest.mark.parametrize("merge_lora", [False, True], ids=["lora", "merged"])
def test_decomposed_onnx_runs_in_onnxruntime_as_torch(merge_lora, tmp_path):
    import onnx
    import onnxruntime

    model = tiny_lora_model("llama", num_hidden_layers=1)
    graphopt.export(model, batch(2, 16), tmp_path, format="onnx", decompose=True, merge_lora=merge_lora)
    proto = onnx.load(tmp_path / "model.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert not graphopt_nodes(proto) and {o.domain for o in proto.opset_import} == {""}
    assert proto.graph.input[0].name == "input_ids" and proto.graph.output[0].name == "logits"
    assert [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim] == ["batch", "seq"]

    session = onnxruntime.InferenceSession(tmp_path / "model.onnx")
    for size, length in ((2, 16), (3, 7)):
        inputs = batch(size, length)
        logits = session.run(["logits"], {name: t.numpy() for name, t in inputs.items()})[0]
        assert relative_error(logits, eager_logits(model, inputs), inputs["attention_mask"]) <= 1e-4


def _reference_ops():
    """onnx's reference evaluator kernels for the com.graphopt ops: graphopt's own references (the definition of
    each schema) on numpy arrays, the attributes as the schemas name them."""
    from onnx.helper import tensor_dtype_to_np_dtype
    from onnx.reference.op_run import OpRun

    from graphopt.kernels import reference

    def kernel(name, run):
        def _run(self, *inputs, **attributes):
            tensors = [None if x is None else torch.from_numpy(x.copy()) for x in inputs]
            if "out_dtype" in attributes:
                attributes["out_dtype"] = getattr(torch, str(tensor_dtype_to_np_dtype(attributes["out_dtype"])))
            outputs = run(*tensors, **attributes)
            return tuple(t.contiguous().numpy() for t in (outputs if isinstance(outputs, tuple) else (outputs,)))

        return type(name, (OpRun,), {"op_domain": "com.graphopt", "_run": _run})

    return [
        kernel("rms_norm", lambda x, w, eps, weight_offset, out_dtype: reference.rms_norm(x, w, eps, weight_offset,
                                                                                          out_dtype)),
        kernel("gated_activation", lambda g, u, activation: reference.gated_activation(g, u, activation)),
        kernel("rope", lambda q, k, cos, sin: reference.rope(q, k, cos, sin)),
        kernel("lora_down", lambda x, a: reference.lora_down(x, a)),
        kernel("lora_linear", lambda x, w, b, bb, xa, scaling, out_dtype: reference.lora_linear(x, w, b, None, bb, xa,
                                                                                                scaling, out_dtype)),
        kernel("padded_attention", lambda q, k, v, keep, scale, window=None: reference.padded_attention(
            q, k, v, keep, scale, window)),
        kernel("packed_attention", lambda q, k, v, p, scale, window=None: reference.packed_attention(
            q, k, v, p, scale, window)),
    ]


@needs_onnx
@pytest.mark.parametrize("merge_lora", [False, True], ids=["lora", "merged"])
def test_the_com_graphopt_onnx_names_each_op_once_per_use(merge_lora, tmp_path):
    import onnx
    from onnx.reference import ReferenceEvaluator

    model = tiny_lora_model("llama", num_hidden_layers=1)
    graphopt.export(model, batch(2, 16), tmp_path, format="onnx", merge_lora=merge_lora)
    proto = onnx.load(tmp_path / "model.onnx")
    onnx.checker.check_model(proto, full_check=True)  # every com.graphopt node against its registered schema
    assert {(o.domain, o.version) for o in proto.opset_import} >= {("com.graphopt", 3)}
    program_ops = json.loads((tmp_path / "export.json").read_text())["graphopt_ops"]
    assert graphopt_nodes(proto) == {op.split(".")[1]: count for op, count in program_ops.items()}
    adapted = len(adapted_layers(model))
    assert graphopt_nodes(proto)["lora_linear"] == graphopt_nodes(proto)["lora_down"] == (0 if merge_lora else adapted)
    assert graphopt_nodes(proto)["rms_norm"] == rms_norm_modules(model)

    # the nodes compute their schemas' definitions: run with graphopt's references as the domain's kernels
    inputs = batch(2, 8)
    logits = ReferenceEvaluator(proto, new_ops=_reference_ops()).run(
        ["logits"], {name: t.numpy() for name, t in inputs.items()})[0]
    assert relative_error(logits, eager_logits(model, inputs), inputs["attention_mask"]) <= 1e-4


# --- "mlir" -------------------------------------------------------------------------------------------------

@pytest.mark.skipif(bool(_missing("torch_mlir")), reason="torch-mlir is not installed (pip install graphopt[mlir])")
@pytest.mark.parametrize("output", ["torch", "linalg-on-tensors", "stablehlo", "tosa"])
def test_mlir_of_each_output_type(output, tmp_path):
    model = tiny_lora_model("llama", num_hidden_layers=1)
    graphopt.export(model, {"input_ids": batch(2, 8)["input_ids"]}, tmp_path, format="mlir", mlir_output=output)
    text = (tmp_path / "model.mlir").read_text()
    argument = {"torch": "!torch.vtensor<[?,?],si64>", "linalg-on-tensors": "tensor<?x?xi64>"}.get(
        output, "tensor<2x8xi64>")  # StableHLO and TOSA at the example's sizes
    assert f"func.func @forward(%arg0: {argument})" in text
    if output == "torch":  # read back and verified by torch-mlir's own parser and verifier
        from torch_mlir import ir
        from torch_mlir.dialects import torch as torch_dialect

        context = ir.Context()
        torch_dialect.register_dialect(context)
        module = ir.Module.parse(text, context)
        assert module.operation.verify()
        assert [op.operation.name for op in module.body.operations] == ["func.func"]


@pytest.mark.parametrize("format, hidden, extra", [("onnx", ["onnxscript"], "onnx"),
                                                   ("mlir", ["torch_mlir", "torch_mlir.fx"], "mlir")])
def test_a_format_without_its_packages_names_the_extra(format, hidden, extra, tmp_path, monkeypatch):
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # import → ImportError
    monkeypatch.delitem(sys.modules, "graphopt.export_onnx", raising=False)
    monkeypatch.delattr(graphopt, "export_onnx", raising=False)
    with pytest.raises(ImportError, match=rf"pip install graphopt\[{extra}\]"):
        graphopt.export(tiny_lora_model("llama"), batch(2, 8), tmp_path / "out", format=format)
    assert not (tmp_path / "out").exists()


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


@needs_onnx
def test_an_op_without_a_translation_is_refused_with_the_way_out(tmp_path, monkeypatch):
    from graphopt import export_onnx

    monkeypatch.delitem(export_onnx.TRANSLATIONS, torch.ops.graphopt.rope.default)
    with pytest.raises(ExportError, match=r"graphopt\.rope\.default has no com\.graphopt translation: export with "
                                          r"decompose=True"):
        graphopt.export(tiny_lora_model("llama", num_hidden_layers=1), batch(2, 8), tmp_path / "out", format="onnx")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(bool(_missing("bitsandbytes")), reason="bitsandbytes is not installed")
def test_a_quantized_base_is_refused(tmp_path):
    import bitsandbytes

    model = tiny_lora_model("llama")
    model.base_model.model.model.layers[1].mlp.down_proj = bitsandbytes.nn.Linear4bit(128, 64)
    with pytest.raises(ExportError, match=r"model\.model\.layers\.1\.mlp\.down_proj is a bitsandbytes Linear4bit: a "
                                          r"quantized base \(QLoRA\) is not exported.*load the base unquantized"):
        graphopt.export(model, batch(2, 8), tmp_path / "out")
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

def test_the_command_line_exports(tmp_path, capsys):
    from graphopt.plan_dir import main

    main(["models:tiny_llama", "--out", str(tmp_path / "out"), "--batch", "2", "--seq", "8", "--dtype", "fp32",
          "--device", "cpu", "--export", "torch", "--merge-lora"])
    printed = capsys.readouterr().out
    assert "torch export written to" in printed and "graphopt.load(" in printed
    described = json.loads((tmp_path / "out" / "export.json").read_text())
    assert described["merge_lora"] and described["inputs"]["input_ids"].startswith("int64[2, 8]")
