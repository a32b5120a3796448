"""QLoRA's base matmul three ways, at the projections of one decoder layer (CUDA only):

    python benchmarks/matmul_4bit.py                # Llama-3.2-1B: 8192 tokens (batch 4 × 2048)
    python benchmarks/matmul_4bit.py --shape 8b     # Llama-3-8B: 4096 tokens (batch 2 × 2048)

  w4a16       kernels/matmul_4bit.py: the NF4 weight (double quantization) dequantized in the kernel's main loop
  dequant     bitsandbytes' dequantize_4bit into a temporary, then cuBLAS (what graphopt::lora_linear_4bit runs now)
  bf16        cuBLAS on the bf16 weight (LoRA without quantization: the bound)

Forward y = x·Wᵀ and the backward's dX = dY·W, bf16 activations, µs per call (triton.testing.do_bench) and the
sum over one layer's seven projections. Which of w4a16 and dequant the CUDA lowering takes is chosen from this.
"""

import argparse

import torch
from triton.testing import do_bench

from graphopt.kernels import matmul_4bit

SHAPES = {"1b": dict(tokens=8192, hidden=2048, kv=512, intermediate=8192),
          "8b": dict(tokens=4096, hidden=4096, kv=1024, intermediate=14336)}


def projections(shape):
    """(name, out_features, in_features) of one decoder layer's seven projections."""
    s = SHAPES[shape]
    return [("q", s["hidden"], s["hidden"]), ("k", s["kv"], s["hidden"]), ("v", s["kv"], s["hidden"]),
            ("o", s["hidden"], s["hidden"]), ("gate", s["intermediate"], s["hidden"]),
            ("up", s["intermediate"], s["hidden"]), ("down", s["hidden"], s["intermediate"])]


def main() -> None:
    from bitsandbytes import functional as bnb

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    args = parser.parse_args()
    tokens, totals = SHAPES[args.shape]["tokens"], {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.shape}: {tokens} tokens, bf16, µs\n")
    print("| projection | direction | w4a16 | dequant | bf16 | w4a16 rel err |\n"
          "| --- | --- | ---: | ---: | ---: | ---: |")
    for name, n, k in projections(args.shape):
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
        base = (packed, [n, k], state.state2.absmax, 64, "nf4", state.absmax, state.state2.code, state.offset)
        dense = bnb.dequantize_4bit(packed, state)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        runs = {
            "forward": (lambda: matmul_4bit.forward(x, *base, torch.bfloat16),
                        lambda: x @ bnb.dequantize_4bit(packed, state).t(), lambda: x @ weight.t(),
                        lambda: x.float() @ dense.float().t()),
            "dX": (lambda: matmul_4bit.backward(grad, *base, torch.bfloat16),
                   lambda: grad @ bnb.dequantize_4bit(packed, state), lambda: grad @ weight,
                   lambda: grad.float() @ dense.float()),
        }
        for direction, (fused, dequant, plain, exact) in runs.items():
            want = exact()
            error = ((fused().float() - want).norm() / want.norm()).item()
            times = [do_bench(f) * 1e3 for f in (fused, dequant, plain)]
            for what, t in zip(("w4a16", "dequant", "bf16"), times):
                totals[direction, what] = totals.get((direction, what), 0.0) + t
            print(f"| {name} [{n} × {k}] | {direction} | {times[0]:,.0f} | {times[1]:,.0f} | {times[2]:,.0f} | "
                  f"{error:.1e} |")
    for direction in ("forward", "dX"):
        print(f"| layer | {direction} | " + " | ".join(f"{totals[direction, w]:,.0f}"
                                                      for w in ("w4a16", "dequant", "bf16")) + " | |")


if __name__ == "__main__":
    main()
