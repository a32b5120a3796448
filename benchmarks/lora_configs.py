"""Sweep the launch configurations of kernels/lora.py at the Llama-3.2-1B shapes (CUDA only).

    python benchmarks/lora_configs.py            # prints, per kernel, IEEE vs tf32x3 and the 4 best configs

Each kernel is timed (triton.testing.do_bench, µs) on the shapes one decoder layer gives it — 8192 tokens,
hidden 2048, intermediate 8192, 8 KV heads × 64 (k/v width 512), LoRA r=16 — and the times are summed weighted
by how often a training step of one layer calls it (forward, and the backward that recomputes x·Aᵀ). The best
config per kernel is what kernels/lora.py CONFIGS["cuda"] should hold.
"""

import itertools
import sys

import torch
from triton.testing import do_bench

from graphopt.kernels import lora

TOKENS, RANK = 8192, 16
WIDTHS = (512, 2048, 8192)  # k/v, hidden, intermediate

GRIDS = {
    "project": [dict(BLOCK_M=m, BLOCK_K=k, num_warps=w, num_stages=s)
                for m, k, w, s in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (3, 4))],
    "reduce_rows": [dict(BLOCK_M=m, BLOCK_N=n, programs=p, num_warps=w, num_stages=3)
                    for m, n, p, w in itertools.product((32, 64), (64, 128), (264, 528, 1056), (4, 8))],
    "add_low_rank": [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=3)
                     for m, n, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))],
}


def cases():
    """{kernel: [(call, calls per layer and step)]}."""
    rows = {w: torch.randn(TOKENS, w, device="cuda", dtype=torch.bfloat16) for w in WIDTHS}
    a = {w: torch.randn(RANK, w, device="cuda") * 0.02 for w in WIDTHS}  # lora_A [r, in]
    b = {w: torch.randn(w, RANK, device="cuda") * 0.02 for w in WIDTHS}  # lora_B [out, r]
    low = torch.randn(TOKENS, RANK, device="cuda")

    def project_x(w):  # x·Aᵀ
        return lambda: lora._project(rows[w], a[w], a[w].stride(0), a[w].stride(1), RANK, 1.0)

    def project_grad(w):  # dY·B
        return lambda: lora._project(rows[w], b[w], b[w].stride(1), b[w].stride(0), RANK, 1.0)

    def reduce_rows(w):
        return lambda: lora._reduce_rows(low, rows[w])

    def add_low_rank(w):
        return lambda: lora._add_low_rank(rows[w], low, b[w], b[w].stride(0), b[w].stride(1), 1.0,
                                          torch.bfloat16, False)

    # Per layer: inputs of width 2048 to q, k, v, o, gate, up and 8192 to down (each read in the forward and
    # again in the backward); outputs 2048 (q, o, down), 512 (k, v), 8192 (gate, up).
    return {
        "project": [(project_x(2048), 12), (project_x(8192), 2), (project_grad(2048), 3), (project_grad(512), 2),
                    (project_grad(8192), 2)],
        "reduce_rows": [(reduce_rows(2048), 9), (reduce_rows(512), 2), (reduce_rows(8192), 3)],
        "add_low_rank": [(add_low_rank(2048), 9), (add_low_rank(512), 2), (add_low_rank(8192), 3)],
    }


def weighted_time(calls):
    per_shape = [do_bench(call, warmup=3, rep=20) * 1000 for call, _ in calls]
    return sum(t * n for t, (_, n) in zip(per_shape, calls)), per_shape


def main():
    if not torch.cuda.is_available():
        sys.exit("lora_configs.py sweeps CUDA launch configurations: it needs a GPU")
    calls = cases()
    current = {name: dict(config) for name, config in lora.CONFIGS["cuda"].items()}
    for name, grid in GRIDS.items():
        results = []
        for precision, config in [("ieee", current[name])] + [("tf32x3", c) for c in [current[name]] + grid]:
            lora.PRECISION["cuda"], lora.CONFIGS["cuda"][name] = precision, config
            try:
                results.append((*weighted_time(calls[name]), precision, config))
            except Exception as error:  # a config the GPU cannot run (out of shared memory, ...)
                print(f"  {name} {config}: {type(error).__name__}")
        lora.PRECISION["cuda"], lora.CONFIGS["cuda"][name] = "tf32x3", current[name]
        print(f"\n{name}: µs per layer and step, weighted (per shape)")
        for label, (total, per_shape, *_) in [("current, ieee", results[0]),
                                                              ("current, tf32x3", results[1])]:
            print(f"  {label:<16} {total:9.1f}  {[round(t, 1) for t in per_shape]}")
        for total, per_shape, _, config in sorted(results[2:], key=lambda r: r[0])[:4]:
            print(f"  {total:9.1f}  {[round(t, 1) for t in per_shape]}  {config}")


if __name__ == "__main__":
    main()
