"""Time to the first training step: a cold compile against a process given a plan directory (graphopt.optimize).

    python benchmarks/compile_reuse.py --shape 1b [--json results.jsonl]

Three processes, one after the other, each with empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR of its own:
graphopt.optimize writes the plan directory, then a cold compile and a compile with options={"plan": DIR} each
time a first step (from the compiled model made to the step done: Dynamo, graphopt, the compile or its load, the
step) and then the mean of 10 steps after 3 more (where CUDA graph trees record). Model and batches as
benchmarks/train_step.py's (one fixed batch; bf16 on a GPU, fp32 on the CPU, where the tiny shape runs 2 × 64).
One process per mode (--mode) is what the driver runs. --profile prints where the plan process's first step goes
(cProfile, by cumulative time).
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import train_step as ts  # noqa: E402


def one_process(mode, shape, plan_dir, profile=False) -> dict:
    import graphopt

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = ts.add_lora(ts.build_model(ts.llama_config(shape, "fixed"), dtype, device))
    model.train()
    batch, seq = {"8b": 2, "tiny": 2}.get(shape, 4), {"tiny": 64}.get(shape, 2048)
    vocab = model.get_input_embeddings().weight.shape[0]
    batches, _ = ts.make_batches("fixed", batch, seq, 14, vocab, device)
    ts.synchronize(device)
    start = time.perf_counter()
    if mode == "optimize":
        graphopt.optimize(model, batches[0], plan_dir)
        ts.synchronize(device)
        return {"mode": mode, "shape": shape, "seconds": time.perf_counter() - start}
    profiler = cProfile.Profile() if profile and mode == "plan" else None
    if profiler:
        profiler.enable()
    forward = torch.compile(model, backend="graphopt", options={"plan": plan_dir} if mode == "plan" else {})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ts.LEARNING_RATE)
    first_loss = ts.train_step(forward, optimizer, batches[0]).item()
    ts.synchronize(device)
    first_step_s = time.perf_counter() - start
    if profiler:
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        # the stages: Dynamo's trace, graphopt's passes, AOTAutograd's and Inductor's cache loads, Triton's loads
        stats.sort_stats("cumulative").print_stats("convert_frame|graphopt|compile_fx|autograd_cache|codecache|"
                                                   "triton|cudagraph", 40)
        stats.sort_stats("tottime").print_stats(15)
        print(text.getvalue(), file=sys.stderr)
    for b in batches[1:4]:
        ts.train_step(forward, optimizer, b)
    ts.synchronize(device)
    start = time.perf_counter()
    for b in batches[4:]:
        loss = ts.train_step(forward, optimizer, b)
    ts.synchronize(device)
    counters = torch._dynamo.utils.counters
    return {"mode": mode, "shape": shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else
            "cpu", "torch": torch.__version__, "first_step_s": first_step_s,
            "step_ms": (time.perf_counter() - start) / len(batches[4:]) * 1e3, "first_loss": first_loss,
            "loss": loss.item(), "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(ts.SHAPES), default="1b")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per process to PATH")
    parser.add_argument("--profile", action="store_true", help="cProfile the plan process's first step")
    parser.add_argument("--mode", choices=("optimize", "cold", "plan"), help=argparse.SUPPRESS)
    parser.add_argument("--plan-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(one_process(args.mode, args.shape, args.plan_dir, args.profile)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        plan_dir = os.path.join(scratch, "plan")
        for mode in ("optimize", "cold", "plan"):
            caches = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, mode, "inductor"),
                      "TRITON_CACHE_DIR": os.path.join(scratch, mode, "triton")}
            done = subprocess.run([sys.executable, __file__, "--mode", mode, "--shape", args.shape, "--plan-dir",
                                   plan_dir] + ["--profile"] * args.profile, env={**os.environ, **caches},
                                  capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{mode} failed:\n{done.stderr[-4000:]}")
            if args.profile and mode == "plan":
                print(done.stderr[done.stderr.find("function calls"):].replace(os.path.dirname(torch.__file__), "torch"))
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold = rows[1]["first_step_s"]
    print("| process | first step s | ×cold | step ms | cache hits (AOTAutograd, FX graph) |\n"
          "| --- | ---: | ---: | ---: | --- |")
    print(f"| graphopt.optimize | {rows[0]['seconds']:.1f} (the optimize call) | | | |")
    for row in rows[1:]:
        print(f"| {row['mode']} | {row['first_step_s']:.1f} | {row['first_step_s'] / cold:.0%} | "
              f"{row['step_ms']:.1f} | {row['autograd_cache_hit']}, {row['fxgraph_cache_hit']} |")
    if args.json:
        with open(args.json, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
