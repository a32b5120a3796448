"""The "torch" export on the GPU: graphopt.export's program, read back with graphopt.load, against the eager model
and torch.compile inference (Inductor), at the 1B Llama shape.

    python benchmarks/export_forward.py [--batch 4 --seq 2048 --repeats 10]

The model is benchmarks/train_step.py's: Llama-3.2-1B's shape from a config with random weights, bf16, PEFT LoRA
r=16 on the 7 projections (fp32 adapters, PEFT's default), in eval mode. Every variant gets the same batch:
random tokens and an all-ones attention_mask, as a tokenizer hands them over (with the mask the export's attention
is graphopt::padded_attention; --no-mask leaves it out). Logits are compared with the eager model's: the largest
difference over the largest logit, and ‖Δ‖/‖eager‖. Forward time: the median of --repeats calls after 3 warm-up
calls, without gradients. Prints a markdown table for benchmarks/RESULTS.md; needs CUDA.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import train_step as ts  # noqa: E402
from common import device_name  # noqa: E402


def forward_ms(forward, inputs, repeats, warmup=3) -> float:
    with torch.no_grad():
        for _ in range(warmup):
            forward(inputs)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            forward(inputs)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def errors(out, ref) -> tuple:
    """(max |out − ref| / max |ref|, ‖out − ref‖ / ‖ref‖), in fp32."""
    diff = out.float() - ref.float()
    return (diff.abs().max() / ref.float().abs().max()).item(), (diff.norm() / ref.float().norm()).item()


def main(argv=None) -> None:
    import graphopt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-mask", action="store_true", help="input_ids alone, without an attention_mask")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("export_forward.py measures the export on a CUDA GPU; none is available")
    device = torch.device("cuda")
    model = ts.add_lora(ts.build_model(ts.llama_config("1b"), torch.bfloat16, device)).eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    inputs = {"input_ids": ids} if args.no_mask else {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        graphopt.export(model, inputs, folder)
        exported_s = time.perf_counter() - start
        fusions = graphopt.last_report().summary()
        start = time.perf_counter()
        program = graphopt.load(folder)
        loaded_s = time.perf_counter() - start
    compiled = torch.compile(model)

    variants = {
        "eager": lambda x: model(**x, use_cache=False).logits,
        "torch.compile (Inductor)": lambda x: compiled(**x, use_cache=False).logits,
        "graphopt \"torch\" export (graphopt.load)": lambda x: program(**x)["logits"],
    }
    with torch.no_grad():
        start = time.perf_counter()
        logits = {name: forward(inputs) for name, forward in variants.items()}  # Inductor compiles here
        first_s = time.perf_counter() - start
    rows = []
    for name, forward in variants.items():
        largest, norm = errors(logits[name], logits["eager"])
        rows.append(f"| {name} | {largest:.2e} | {norm:.2e} | {forward_ms(forward, inputs, args.repeats):.1f} |")

    print(f"export forward, {device_name(device)}, torch {torch.__version__}, 1B Llama shape, bf16, LoRA r={ts.LORA_R} "
          f"on {len(ts.TARGET_MODULES)} projections, batch {args.batch} × {args.seq}"
          f"{'' if args.no_mask else ' with attention_mask'}")
    print(f"export {exported_s:.1f} s, load {loaded_s:.1f} s, first calls (Inductor's compile) {first_s:.1f} s; "
          f"fusions {fusions}\n")
    print("| variant | logits max rel. error vs eager | ‖Δ‖/‖eager‖ | forward ms (median) |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
