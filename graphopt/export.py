"""Deployment export: the fused model as an inference program, `graphopt.export(model, example_inputs, DIR)` (and
`graphopt optimize MODEL --out DIR --export FORMAT`); docs/export.md is the user's guide.

  1. capture    torch._dynamo.export of the model's forward in eval mode without gradients, batch and sequence
                dimensions symbolic: Dynamo's torch-level graph, with the model's signature and outputs
  2. normalize  the pipeline's own steps 2–3 (graphopt/pipeline.py), on that graph: checkpointed regions
     fuse       inlined, one spelling per op, then the FUSIONS registry in order, so the export's fusions are the
                ones a training compile at dynamic shapes finds
  3. export     torch.export of the fused graph: graphopt's ops stay single calls (their fake kernels give the
                shapes); decompose=True (and MLIR, always) replaces each by its reference (kernels/reference.py)
  4. write      "torch": torch.export.save; "onnx": graphopt/export_onnx.py; "mlir": torch-mlir's FX importer;
                beside it the plan of the export (report.txt/.json/.html) and export.json (what the program takes
                and returns)

Everything the export cannot take is refused before any file is written, with the way out.
"""

import contextlib
import copy
import json
from pathlib import Path

import torch
from torch.export import Dim

from graphopt import model_source
from graphopt import report as render
from graphopt.devices import resolve_target
from graphopt.kernels import reference
from graphopt.lowering import ops  # noqa: F401  (defines torch.ops.graphopt.*)
from graphopt.options import Options, parse_options
from graphopt.passes.describe import graph_inputs
from graphopt.passes.registry import FUSIONS
from graphopt.pipeline import normalize_and_fuse
from graphopt.plan import Plan
from graphopt.report import publish, reports

SCHEMA = "graphopt.export/1"
FILES = {"torch": "model.pt2", "onnx": "model.onnx", "mlir": "model.mlir"}
MLIR_OUTPUTS = ("torch", "linalg-on-tensors", "stablehlo", "tosa")
# torch-mlir lowers these two from static shapes only (symbolic sizes fail to legalize): exported at the example
# inputs' sizes
STATIC_MLIR_OUTPUTS = ("stablehlo", "tosa")
COMMAND_FORMATS = (*FILES, *(f"mlir:{output}" for output in MLIR_OUTPUTS))  # `--export FORMAT`
REPORTS = ("report.txt", "report.json", "report.html")
DESCRIPTION = "export.json"

# The graphopt ops an inference program holds, each defined by its reference (fp32 math): what decompose=True
# and the MLIR export replace them with. The others compute training steps (below) or dequantize a bitsandbytes
# base (lora_linear_4bit: a quantized base is refused, _check).
INFERENCE_OPS = ("rms_norm", "gated_activation", "rope", "lora_down", "lora_linear", "padded_attention",
                 "packed_attention")
REFERENCES = {getattr(torch.ops.graphopt, name).default: getattr(reference, name) for name in INFERENCE_OPS}
TRAINING_OPS = {
    torch.ops.graphopt.linear_cross_entropy.default: "the fused training loss (lm_head + cross-entropy)",
    torch.ops.graphopt.linear_logprobs.default: "TRL's chunked log-prob head, which replaces the lm_head in its "
                                                "trainers",
}
# The options that decide a training step (what the backward saves, offloads, replays): an inference program has
# none of it.
TRAINING_OPTIONS = ("offload", "memory_budget", "max_memory_gib", "cuda_graphs", "keep_logits", "cache_grad", "plan")


class ExportError(ValueError):
    """A model, input or option graphopt.export cannot take; the message names it and the way out."""


def export(model: torch.nn.Module, example_inputs: dict, out_dir, format: str = "torch", decompose: bool = False,
           merge_lora: bool = False, mlir_output: str = "torch", options: dict = None) -> Path:
    """Write an inference program of model's fused forward into out_dir, traced on example_inputs (the model's
    keyword inputs: input_ids, optionally attention_mask or position_ids), their batch and sequence dimensions
    dynamic. format "torch" (torch.export, graphopt.load reads it), "onnx" (graphopt's ops in the com.graphopt
    domain, or standard ONNX ops with decompose=True) or "mlir" (torch-mlir, of output type mlir_output).
    merge_lora: PEFT's merge_and_unload on a copy of the model first; else LoRA stays graphopt's op. options:
    graphopt's `fusions` (and `target`, `report`). The model is left as it was (its mode, its adapters)."""
    options = _check(model, example_inputs, format, mlir_output, options or {})
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / DESCRIPTION).exists():
        raise FileExistsError(f"{out} holds files and no export: name an empty or new directory")
    inputs = {name: v for name, v in example_inputs.items() if isinstance(v, torch.Tensor)}
    with _inference(model, merge_lora) as inference:
        dynamic = format != "mlir" or mlir_output not in STATIC_MLIR_OUTPUTS
        fused, plan, outputs = capture(inference, example_inputs, options, dynamic)
        _check_ops(fused, format, decompose)
        program = torch.export.export(fused, (), inputs, dynamic_shapes=_dynamic_shapes(inputs, dynamic),
                                      strict=False)
    decomposed = decompose or format == "mlir"
    if decomposed:
        program = program.run_decompositions(REFERENCES)
    plan.notes.append(_note(format, dynamic, decomposed, merge_lora, model))

    artifact = _artifact(program, format, mlir_output, list(inputs), outputs)  # in memory: nothing written yet
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model.*"), *(out / name for name in REPORTS)]:  # an earlier export's
        stale.unlink(missing_ok=True)
    path = out / FILES[format]
    if format == "torch":
        torch.export.save(program, path)
    elif format == "onnx":
        artifact.save(path)  # the weights in model.onnx.data beside it when they pass protobuf's 2 GB
    else:
        path.write_text(artifact)
    (out / "report.txt").write_text(render.text(plan) + "\n")
    (out / "report.json").write_text(json.dumps(plan.to_json(), indent=2))
    (out / "report.html").write_text(render.html(plan))
    (out / DESCRIPTION).write_text(json.dumps(_description(model, example_inputs, outputs, format, dynamic,
                                                           decompose, merge_lora, mlir_output, program), indent=2))
    publish(plan, options.report)
    return out


def load(path) -> torch.nn.Module:
    """The "torch" export in directory path, ready to run: program(input_ids=..., ...) returns the model's outputs
    as a dict (logits first). torch.export.load(path / "model.pt2") gives the ExportedProgram itself."""
    path = Path(path)
    if not (path / DESCRIPTION).is_file():
        raise ExportError(f"{path} holds no {DESCRIPTION}: not a directory graphopt.export wrote")
    description = json.loads((path / DESCRIPTION).read_text())
    if description.get("schema") != SCHEMA:
        raise ExportError(f"{path} is not a {SCHEMA} export (schema {description.get('schema')!r}): export again with "
                          f"this graphopt")
    if description["format"] != "torch":
        raise ExportError(f"{path} holds a {description['format']!r} export ({description['file']}): graphopt.load "
                          f"reads \"torch\" exports; run an ONNX file in onnxruntime, an MLIR file with its compiler")
    return torch.export.load(path / description["file"]).module()


def command(model: torch.nn.Module, args) -> None:
    """`graphopt optimize MODEL --out DIR --export FORMAT [--decompose --merge-lora]` (graphopt/plan_dir.py's
    arguments): the export traced on --batch × --seq random tokens."""
    format, _, mlir_output = args.export.partition(":")
    ids = model_source.example_inputs(model, args.batch, args.seq, args.device)["input_ids"]
    out = export(model, {"input_ids": ids}, args.out, format, args.decompose, args.merge_lora, mlir_output or "torch",
                 json.loads(args.options))
    print((out / "report.txt").read_text())
    print(f"{format} export written to {out / FILES[format]}" + (f"; run it with graphopt.load({str(out)!r})"
                                                                  if format == "torch" else ""))


# --- 1–2. capture, normalize, fuse --------------------------------------------------------------------------

def capture(model: torch.nn.Module, example_inputs: dict, options: Options, dynamic: bool = True) -> tuple:
    """(the fused graph as a GraphModule of model's parameters, taking the tensors of example_inputs by name; its
    plan; the names of its outputs, or None for an output that is not a dict). model is in eval mode."""
    constants = {name: v for name, v in example_inputs.items() if not isinstance(v, torch.Tensor)}
    inputs = {name: v for name, v in example_inputs.items() if isinstance(v, torch.Tensor)}
    if hasattr(getattr(model, "config", None), "use_cache"):  # an HF model
        constants.setdefault("use_cache", False)  # the KV cache is generation's state, not the program's output

    def forward(**kwargs):  # the model with its constant inputs bound, its outputs a dict (HF's fields, logits first)
        outputs = model(**kwargs, **constants)
        return dict(outputs) if isinstance(outputs, dict) else outputs

    try:
        with torch.no_grad():
            gm = torch._dynamo.export(forward, dynamic_shapes={"kwargs": _dynamic_shapes(inputs, dynamic)})(
                **inputs).graph_module
    except torch._dynamo.exc.Unsupported as error:
        raise ExportError(f"Dynamo cannot capture the model's forward as one graph, which an export needs: "
                          f"{str(error).splitlines()[0]}") from error
    plan = Plan(graph=len(reports()), options=options.to_json(), nodes_captured=len(gm.graph.nodes),
                target=resolve_target(options.target, list(inputs.values())))
    plan.inputs, plan.parameters = graph_inputs(gm, list(inputs.values()))
    with _sizes_as_inputs(gm):  # 2–3. the pipeline's own normalize and fuse
        normalize_and_fuse(gm, options, plan)
    outputs = gm._out_spec  # the outputs' structure, from the model's
    return _named_after(model, gm), plan, list(outputs.context) if outputs.type is dict else None


@contextlib.contextmanager
def _sizes_as_inputs(gm):
    """Dynamo's export form reads each symbolic size from its tensor (aten.sym_size), where torch.compile's form
    passes it as a graph input; the passes (passes/attention.py reading masks) are written for the latter. The
    sizes are inputs while the passes run, then read from their tensors again."""
    graph, codegen = gm.graph, gm.graph._codegen
    graph._codegen = torch.fx.graph.CodeGen()  # the passes recompile; the signature's codegen comes back after
    sizes = {}
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.sym_size.int)):
        with graph.inserting_before(_first_computation(graph)):
            size = graph.placeholder(node.name)
        size.meta = dict(node.meta)
        sizes[size] = node.args
        node.replace_all_uses_with(size)
        graph.erase_node(node)
    try:
        yield
    finally:
        for size, args in sizes.items():
            if size.users:
                with graph.inserting_before(_first_computation(graph)):
                    node = graph.call_function(torch.ops.aten.sym_size.int, args)
                node.meta = dict(size.meta)
                size.replace_all_uses_with(node)
            graph.erase_node(size)
        graph._codegen = codegen
        gm.recompile()


def _first_computation(graph):
    return next(node for node in graph.nodes if node.op != "placeholder")


def _named_after(model, gm) -> torch.fx.GraphModule:
    """gm with model's parameters and buffers under their own names (Dynamo names them after the path it read
    them by): the exported program's state dict is the model's. Anything else gm holds keeps its name."""
    names = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    attributes = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        attribute = getattr(gm, node.target)
        node.target = names.get(id(attribute), node.target)
        attributes[node.target] = attribute
    return torch.fx.GraphModule(attributes, gm.graph)


def _dynamic_shapes(inputs: dict, dynamic: bool = True) -> dict:
    """Dimension 0 of every tensor input is the batch, dimension 1 of those with two or more the sequence: one
    symbol each, shared by the inputs (so the passes see attention_mask's rows and input_ids' as one batch). Not
    dynamic: every size as in inputs."""
    if not dynamic:
        return {name: None for name in inputs}
    batch, seq = Dim("batch"), Dim("seq")
    return {name: {0: batch, 1: seq} if t.dim() >= 2 else {0: batch} for name, t in inputs.items()}


@contextlib.contextmanager
def _inference(model, merge_lora):
    """model in eval mode (dropout off), or with merge_lora a copy with PEFT's adapters merged into the base
    weights (merge_and_unload); the model's modes come back after."""
    modes = {module: module.training for module in model.modules()}
    try:
        if merge_lora and hasattr(model, "merge_and_unload"):
            yield copy.deepcopy(model).eval().merge_and_unload()
        else:
            yield model.eval()
    finally:
        for module, training in modes.items():
            module.train(training)


# --- what the export cannot take -----------------------------------------------------------------------------

def _check(model, example_inputs, format, mlir_output, raw_options) -> Options:
    """The options parsed; ExportError (or ImportError for a missing package) for what cannot be exported."""
    if format not in FILES:
        raise ExportError(f"format={format!r} is not one of {', '.join(map(repr, FILES))}")
    if format == "mlir" and mlir_output not in MLIR_OUTPUTS:
        raise ExportError(f"mlir_output={mlir_output!r} is not one of {', '.join(map(repr, MLIR_OUTPUTS))}")
    if not isinstance(example_inputs, dict) or not any(isinstance(v, torch.Tensor) for v in example_inputs.values()):
        raise ExportError("example_inputs must be a dict of the model's keyword inputs with at least one tensor, "
                          "e.g. {\"input_ids\": ids}")
    training = sorted(name for name in TRAINING_OPTIONS if name in raw_options)
    if training:
        raise ExportError(f"option {training[0]}= decides a training step (what its backward saves, offloads or "
                          f"replays, or a plan directory of training graphs); an export is an inference program: "
                          f"leave {', '.join(training)} out")
    options = parse_options(raw_options, FUSIONS)
    if "labels" in example_inputs:
        raise ExportError("example_inputs holds labels: the model would compute its training loss, a training-only "
                          "output; an export is an inference program returning the logits: leave labels out")
    if example_inputs.get("use_cache"):
        raise ExportError("use_cache=True: the KV cache is generation state the program does not return; leave "
                          "use_cache out (the export sets it False)")
    quantized = _quantized_layer(model)
    if quantized:
        raise ExportError(f"{quantized[0]} is a bitsandbytes {quantized[1]}: a quantized base (QLoRA) is not exported "
                          f"(its bitsandbytes ops have no torch.export, ONNX or MLIR form here); load the base "
                          f"unquantized (bf16/fp16) with the same adapters to export it, merge_lora=True merging them")
    for name, t in example_inputs.items():
        if isinstance(t, torch.Tensor) and any(size < 2 for size in t.shape[:2]):
            raise ExportError(f"example input {name} has shape {tuple(t.shape)}: its batch and sequence sizes must "
                              f"be at least 2 (torch.export specializes a size of 1 into the program); the program "
                              f"then takes any size")
    if format == "onnx":
        _export_onnx()
    if format == "mlir":
        _torch_mlir()
    return options


def _check_ops(gm, format, decompose):
    """ExportError for a graphopt op the format cannot hold: a training head, or an op without a translation."""
    for node in _graphopt_calls(gm.graph):
        op = node.target
        if op in TRAINING_OPS:
            raise ExportError(f"the fused graph holds {op} ({TRAINING_OPS[op]}), a training-only output: export the "
                              f"model as it runs for inference (without labels or a trainer's patched head), or "
                              f"leave the fusion out (options={{\"fusions\": {{...: False}}}})")
        if op not in REFERENCES:
            raise ExportError(f"{op} has no export form: leave its fusion out (options={{\"fusions\": {{...: "
                              f"False}}}})")
        if format == "onnx" and not decompose:
            _export_onnx().check(node)


def _quantized_layer(model):
    """(module path, class) of the first bitsandbytes layer of model, or None."""
    return next(((name, type(m).__name__) for name, m in model.named_modules()
                 if type(m).__module__.startswith("bitsandbytes")), None)


def _graphopt_calls(graph) -> list:
    return [node for node in graph.nodes if node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "graphopt"]


def _export_onnx():
    try:
        from graphopt import export_onnx
    except ImportError as error:
        raise ImportError(f"format=\"onnx\" needs onnx and onnxscript ({error}): pip install graphopt[onnx]") from error
    return export_onnx


def _torch_mlir():
    try:
        import torch_mlir.fx
    except ImportError as error:
        raise ImportError(f"format=\"mlir\" needs torch-mlir ({error}): pip install graphopt[mlir]") from error
    return torch_mlir.fx


# --- 4. the artifacts -----------------------------------------------------------------------------------------

def _artifact(program, format, mlir_output, input_names, output_names):
    """The ONNX program or MLIR text, made in memory (the "torch" program is saved as it is)."""
    if format == "onnx":
        return _export_onnx().to_onnx(program, input_names, output_names)
    if format == "mlir":
        module = _torch_mlir().export_and_import(program, output_type=mlir_output, func_name="forward")
        return str(module)
    return None


def _note(format, dynamic, decomposed, merge_lora, model) -> str:
    ops = "each graphopt op replaced by its reference (kernels/reference.py)" if decomposed else \
        "graphopt's ops kept" + (" as com.graphopt ONNX ops" if format == "onnx" else
                                 " (graphopt.load registers them)")
    merged = ("LoRA merged into the base weights by PEFT's merge_and_unload (on a copy)" if merge_lora and
              hasattr(model, "merge_and_unload") else
              "merge_lora=True: the model has no PEFT adapters to merge" if merge_lora else
              "LoRA kept as graphopt::lora_down and graphopt::lora_linear where it fused")
    shapes = "batch and sequence dynamic" if dynamic else "static shapes (the example inputs')"
    return f"export (format {format!r}): an inference program, {shapes}; {ops}; {merged}"


def _description(model, example_inputs, outputs, format, dynamic, decompose, merge_lora, mlir_output,
                 program) -> dict:
    from graphopt.plan_dir import model_fingerprint, tensor_text, versions

    ops = {}
    for node in _graphopt_calls(program.graph):
        ops[str(node.target)] = ops.get(str(node.target), 0) + 1
    return {"schema": SCHEMA, "format": format, "file": FILES[format], "decompose": decompose,
            "merge_lora": merge_lora, "mlir_output": mlir_output if format == "mlir" else None,
            "inputs": {name: tensor_text(v) for name, v in example_inputs.items()},
            "dynamic": {"batch": "dimension 0 of every tensor input", "seq": "dimension 1"} if dynamic else None,
            "outputs": outputs, "graphopt_ops": ops, "versions": versions(), "model": model_fingerprint(model)}
