"""Sweep the launch configurations of kernels/lora.py at the shapes of one decoder layer (CUDA only).

    python benchmarks/lora_configs.py                # Llama-3.2-1B: 8192 tokens (batch 4 × 2048)
    python benchmarks/lora_configs.py --shape 8b     # Llama-3-8B: 4096 tokens (batch 2 × 2048)
    python benchmarks/lora_configs.py --shape 8b --kernels project     # one kernel's sweep

Prints, per kernel, IEEE vs tf32x3 at the current config and the best configs (4, or --top). Each kernel is timed
(triton.testing.do_bench, µs) on the shapes one decoder layer gives it (LoRA r=16), and the times are summed
weighted by how often a training step of one layer calls it (the forward's x·Aᵀ, the backward's dY·B).
The best config per kernel is what kernels/lora.py CONFIGS["cuda"] should hold; the reduce's number of programs
is not swept: it is 4 × the GPU's SMs (kernels/layout.py multiprocessors). The projections' FILL is: the programs
wanted a multiprocessor, made up by splitting the columns (0: no split); the time includes the sum of the splits.
Their TRACED_COLUMNS is not swept: it splits the columns where the launches are traced into a graph of dynamic
shapes (kernels/lora.py _column_splits), which these calls are not; the training step measures it
(benchmarks/RESULTS.md, SFT AG).
"""

import argparse
import itertools
import sys

import torch
from triton.testing import do_bench

from graphopt.kernels import lora

RANK = 16
# tokens, and the widths of one layer's adapted linears: hidden (q, o), k/v, intermediate (gate, up; down's input)
SHAPES = {"1b": dict(tokens=8192, hidden=2048, kv=512, intermediate=8192),
          "8b": dict(tokens=4096, hidden=4096, kv=1024, intermediate=14336)}


GRIDS = {
    "project": [dict(BLOCK_M=m, BLOCK_K=k, num_warps=w, num_stages=s, FILL=f,
                     TRACED_COLUMNS=lora.CONFIGS["cuda"]["project"]["TRACED_COLUMNS"])
                for m, k, w, s, f in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4), (0, 1, 2, 4))],
    "reduce_rows": [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=3)
                    for m, n, w in itertools.product((32, 64), (64, 128), (4, 8))],
    "add_low_rank": [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=3)
                     for m, n, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))],
    "sum_splits": [dict(BLOCK=b, num_warps=w) for b, w in itertools.product((256, 512, 1024, 2048), (2, 4, 8))],
}


def cases(shape, device="cuda"):
    """{kernel: [(call, calls per layer and step)]} at SHAPES[shape]."""
    tokens, hidden, kv, intermediate = (SHAPES[shape][k] for k in ("tokens", "hidden", "kv", "intermediate"))
    # per layer: (in, out) widths of the adapted linears and how many have them: q and o, k and v, gate and up, down
    linears = [((hidden, hidden), 2), ((hidden, kv), 2), ((hidden, intermediate), 2), ((intermediate, hidden), 1)]
    widths = (kv, hidden, intermediate)
    rows = {w: torch.randn(tokens, w, device=device, dtype=torch.bfloat16) for w in widths}
    a = {w: torch.randn(RANK, w, device=device) * 0.02 for w in widths}  # lora_A [r, in]
    b = {w: torch.randn(w, RANK, device=device) * 0.02 for w in widths}  # lora_B [out, r]
    low = torch.randn(tokens, RANK, device=device)

    def project_x(w):  # the forward's x·Aᵀ
        return lambda: lora._project(rows[w], a[w], a[w].stride(0), a[w].stride(1), RANK, 1.0)

    def project_grad(w):  # the backward's dY·B: B [out, r] read as its transpose
        return lambda: lora._project(rows[w], b[w], b[w].stride(1), b[w].stride(0), RANK, 1.0)

    def reduce_rows_pair(n_in, n_out):  # dA and dB: the partial sums over row splits, then their sum
        return lambda: lora._reduce_rows_pair(rows[n_in], rows[n_out], low, low, 1.0)

    def add_low_rank(w):
        return lambda: lora._add_low_rank(low, b[w], b[w].stride(0), b[w].stride(1), 1.0, torch.bfloat16, w)

    # add_low_rank per layer: the forward's outputs hidden (q, o, down), kv (k, v), intermediate (gate, up) and
    # the backward's dX, hidden wide for q, k, v, o, gate, up and intermediate for down
    return {
        "project": [(project_x(hidden), 6), (project_x(intermediate), 1),  # q, k, v, o, gate, up; down
                    (project_grad(hidden), 3), (project_grad(kv), 2), (project_grad(intermediate), 2)],
        "reduce_rows": [(reduce_rows_pair(*w), n) for w, n in linears],
        "add_low_rank": [(add_low_rank(hidden), 9), (add_low_rank(kv), 2), (add_low_rank(intermediate), 3)],
        "sum_splits": [(reduce_rows_pair(*w), n) for w, n in linears],  # timed with the reduce it follows
    }


def weighted_time(calls):
    # the median: as means, two timings of the same kernels (the ieee and tf32x3 rows, alike for bf16 inputs)
    # differed by up to 25% on the H200
    per_shape = [do_bench(call, warmup=3, rep=20, return_mode="median") * 1000 for call, _ in calls]
    return sum(t * n for t, (_, n) in zip(per_shape, calls)), per_shape


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--kernels", default=",".join(GRIDS), help=f"comma-separated, from {', '.join(GRIDS)}")
    parser.add_argument("--top", type=int, default=4, help="how many of the best configs to print")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lora_configs.py sweeps CUDA launch configurations: it needs a GPU")
    print(f"{args.shape}: {SHAPES[args.shape]}, LoRA r={RANK}")
    calls = cases(args.shape)
    current = {name: dict(config) for name, config in lora.CONFIGS["cuda"].items()}
    for name in args.kernels.split(","):
        grid = GRIDS[name]
        results = []
        for precision, config in [("ieee", current[name])] + [("tf32x3", c) for c in [current[name]] + grid]:
            lora.PRECISION["cuda"], lora.CONFIGS["cuda"][name] = precision, config
            lora._FITTED.clear()  # the configs that fit were found for the config before
            try:
                timed = weighted_time(calls[name])
            except Exception as error:  # a config the GPU cannot run
                print(f"  {name} {config}: {type(error).__name__}")
                continue
            if lora._FITTED:  # it ran shrunk to fit shared memory (kernels/lora.py _fitting): not this config's time
                print(f"  {name} {config}: needs more shared memory than the GPU has")
                continue
            results.append((*timed, precision, config))
        lora.PRECISION["cuda"], lora.CONFIGS["cuda"][name] = "tf32x3", current[name]
        print(f"\n{name}: µs per layer and step, weighted (per shape)")
        for label, (total, per_shape, *_) in [("current, ieee", results[0]),
                                                              ("current, tf32x3", results[1])]:
            print(f"  {label:<16} {total:9.1f}  {[round(t, 1) for t in per_shape]}")
        for total, per_shape, _, config in sorted(results[2:], key=lambda r: r[0])[:args.top]:
            print(f"  {total:9.1f}  {[round(t, 1) for t in per_shape]}  {config}")


if __name__ == "__main__":
    main()
