"""What graphopt would do to a model, without its weights, a GPU or a training step: `graphopt explain MODEL`.

The model is built on the meta device (shapes and dtypes, no data), traced by Dynamo with its training step
(forward with labels, then backward), and every stage of the pipeline decides as it would for the target named:
fusions and misses, the lowering, the memory plan and its estimated peak at that batch. Nothing is compiled: the
traced graphs run on meta tensors. The plans are graphopt.reports() as after a real compile.
"""

import argparse
import json

import torch

from graphopt.options import parse_options
from graphopt.passes.registry import FUSIONS
from graphopt.pipeline import compile_graph
from graphopt.report import reports

NOTE = "explain: traced on the meta device for this target; nothing was compiled or run"
# On the meta device SDPA takes its math form, and the partitioner sees its [B, H, L, L] weights, which a GPU's
# fused attention kernels never hold
GPU_NOTE = ("explain: attention unmasked or causal is traced in SDPA's math form here, so the memory estimate "
            "counts its [batch, heads, length, length] weights, which the GPU's fused kernels do not keep: an "
            "upper bound, and memory_budget=\"auto\" may choose a leaner plan than the GPU compile does")


def explain(model: torch.nn.Module, example_inputs: dict, options: dict = None, target: str = "cuda") -> list:
    """The plans of model's training step on example_inputs (meta tensors, like the model), for target."""
    options = parse_options({**(options or {}), "target": target}, FUSIONS)
    first = len(reports())

    def backend(gm, inputs):
        return compile_graph(gm, inputs, options, explain=True)

    torch._dynamo.reset()
    try:
        outputs = torch.compile(model, backend=backend)(**example_inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) and "loss" in outputs else None
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    finally:
        torch._dynamo.reset()
    plans = reports()[first:]
    for plan in plans:
        plan.notes += [NOTE] + ([GPU_NOTE] if target in ("cuda", "hip") else [])
    return plans


def main(argv=None) -> None:
    """`graphopt explain MODEL [--batch B --seq S --target T --options JSON]`."""
    from graphopt.model_source import example_inputs, load_model

    parser = argparse.ArgumentParser(prog="graphopt explain", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF model directory (a config.json suffices) or module:factory")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--target", default="cuda", help="the device kind to plan for: cuda, hip, npu, mps, cpu")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="LoRA rank on the usual projections of a model without adapters (0: as it is)")
    parser.add_argument("--options", default="{}", help="graphopt's options as JSON, e.g. '{\"memory_budget\": 0}'")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = load_model(args.model, dtype, "meta", args.lora_rank)
    inputs = example_inputs(model, args.batch, args.seq, "meta")
    for plan in explain(model, {**inputs, "use_cache": False}, json.loads(args.options), args.target):
        print(plan.to_text())
