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
# Per layer: (in, out) widths of the adapted linears and how many have them: q and o, k and v, gate and up, down
LINEARS = [((2048, 2048), 2), ((2048, 512), 2), ((2048, 8192), 2), ((8192, 2048), 1)]

GRIDS = {
    "project": [dict(BLOCK_M=m, BLOCK_K=k, num_warps=w, num_stages=s)
                for m, k, w, s in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (3, 4))],
    "reduce_rows": [dict(BLOCK_M=m, BLOCK_N=n, programs=p, num_warps=w, num_stages=3)
                    for m, n, p, w in itertools.product((32, 64), (64, 128), (264, 528, 1056), (4, 8))],
    "add_low_rank": [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=3)
                     for m, n, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))],
    "sum_splits": [dict(BLOCK=b, num_warps=w) for b, w in itertools.product((256, 512, 1024, 2048), (2, 4, 8))],
}


def cases():
    """{kernel: [(call, calls per layer and step)]}."""
    rows = {w: torch.randn(TOKENS, w, device="cuda", dtype=torch.bfloat16) for w in WIDTHS}
    a = {w: torch.randn(RANK, w, device="cuda") * 0.02 for w in WIDTHS}  # lora_A [r, in]
    b = {w: torch.randn(w, RANK, device="cuda") * 0.02 for w in WIDTHS}  # lora_B [out, r]
    low = torch.randn(TOKENS, RANK, device="cuda")

    def project_x(w):  # the forward's x·Aᵀ
        return lambda: lora._project(rows[w], a[w], a[w].stride(0), a[w].stride(1), RANK, 1.0)

    def project_pair(n_in, n_out):  # the backward's x·Aᵀ and dY·B
        return lambda: lora._project_pair(rows[n_in], rows[n_out], a[n_in], b[n_out], 1.0)

    def reduce_rows_pair(n_in, n_out):  # dA and dB: the partial sums over row splits, then their sum
        return lambda: lora._reduce_rows_pair(rows[n_in], rows[n_out], low, low)

    def add_low_rank(w):
        return lambda: lora._add_low_rank(rows[w], low, b[w], b[w].stride(0), b[w].stride(1), 1.0,
                                          torch.bfloat16, False)

    # add_low_rank per layer: the forward's outputs 2048 (q, o, down), 512 (k, v), 8192 (gate, up) and the
    # backward's dX, 2048 wide for q, k, v, o, gate, up and 8192 for down
    return {
        "project": [(project_x(2048), 6), (project_x(8192), 1)] + [(project_pair(*w), n) for w, n in LINEARS],
        "reduce_rows": [(reduce_rows_pair(*w), n) for w, n in LINEARS],
        "add_low_rank": [(add_low_rank(2048), 9), (add_low_rank(512), 2), (add_low_rank(8192), 3)],
        "sum_splits": [(reduce_rows_pair(*w), n) for w, n in LINEARS],  # timed with the reduce it follows
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
