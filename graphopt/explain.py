"""What graphopt would do to a model, without its weights, a GPU or a training step: `graphopt explain MODEL`.

The model is built on the meta device (shapes and dtypes, no data), traced by Dynamo with its training step
(forward with labels, then backward), and every stage of the pipeline decides as it would for the target named:
fusions and misses, the lowering, the memory plan and its estimated peak at that batch. Nothing is compiled: the
traced graphs run on meta tensors, each call the target runs in another form than the meta device's traced in the
target's (the target's lowering's meta_stand_ins: SDPA as a GPU's fused kernels). The plans are graphopt.reports()
as after a real compile.
"""

import argparse
import json

import torch

from graphopt import model_source
from graphopt.options import parse_options
from graphopt.passes.registry import FUSIONS
from graphopt.pipeline import compile_graph
from graphopt.report import reports

NOTE = "explain: traced on the meta device for this target; nothing was compiled or run"


def explain(model: torch.nn.Module, example_inputs: dict, options: dict = None, target: str = "cuda") -> list:
    """The plans of model's training step on example_inputs (meta tensors, like the model), for target."""
    options = parse_options({**(options or {}), "target": target}, FUSIONS)
    first = len(reports())

    def backend(gm, inputs):
        return compile_graph(gm, inputs, options, explain=True)

    torch._dynamo.reset()
    try:
        model_source.training_step(torch.compile(model, backend=backend), example_inputs)
    finally:
        torch._dynamo.reset()
    plans = reports()[first:]
    for plan in plans:
        plan.notes.append(NOTE)
    return plans


def main(argv=None) -> None:
    """`graphopt explain MODEL [--batch B --seq S --target T --options JSON]`."""
    parser = argparse.ArgumentParser(prog="graphopt explain", description=__doc__.splitlines()[0])
    model_source.add_arguments(parser)
    parser.add_argument("--target", default="cuda", help="the device kind to plan for: cuda, hip, npu, mps, cpu")
    args = parser.parse_args(argv)
    model = model_source.load_model(args.model, model_source.DTYPES[args.dtype], "meta", args.lora_rank)
    inputs = model_source.example_inputs(model, args.batch, args.seq, "meta")
    for plan in explain(model, {**inputs, "use_cache": False}, json.loads(args.options), args.target):
        print(plan.to_text())
