"""QLoRA's base dequantization, one decoder layer's seven projections: bitsandbytes' ops (two launches for a
double-quantized weight: the absmax, then the weight) against graphopt's one Triton launch
(kernels/dequantize_4bit.py), NF4 with double quantization, block 64, into bf16. GPU time per call from inside a
CUDA graph (`triton.testing.do_bench_cudagraph`: as the train step replays them, launch costs gone), and the
bytes each call moves (½ byte read and 2 written an element) over that time; each kernel's output against
bitsandbytes' (elements that differ, and by at most how many units in the last place).

    python benchmarks/dequantize_4bit.py --shape 1b [--shape 8b] [--json results.jsonl]
"""

import argparse
import datetime
import json
import sys

import torch
import triton

from common import device_name, version_of

from graphopt.kernels import dequantize_4bit, reference

SHAPES = {"1b": dict(hidden=2048, kv=512, intermediate=8192), "8b": dict(hidden=4096, kv=1024, intermediate=14336)}


def projections(shape):
    hidden, kv, intermediate = (SHAPES[shape][k] for k in ("hidden", "kv", "intermediate"))
    return {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
            "gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}


def quantized(out_features, in_features):
    from bitsandbytes import functional as bnb_functional

    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    return (packed, [out_features, in_features], state.state2.absmax, 64, "nf4", state.absmax, state.state2.code,
            state.offset, torch.bfloat16)


def ulps_apart(a, b):
    """(elements that differ, the most units in the last place between two bf16 tensors)."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia, ib = (torch.where(i < 0, -32768 - i, i) for i in (ia, ib))  # sign-magnitude → ordered integers
    return int((ia != ib).sum()), int((ia - ib).abs().max())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per shape and projection")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dequantize_4bit.py measures CUDA kernels: no GPU here")
    device = torch.device("cuda")
    print("| shape | projection | [out × in] | bitsandbytes µs | graphopt µs | × | graphopt GB/s | differing (max ulp) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shape or ["1b"]:
        total = {"bitsandbytes": 0.0, "graphopt": 0.0}
        for name, (out_features, in_features) in projections(shape).items():
            call = quantized(out_features, in_features)
            differing, ulps = ulps_apart(dequantize_4bit.dequantize_4bit(*call), reference.dequantize_4bit(*call))
            us = {label: 1000 * triton.testing.do_bench_cudagraph(lambda fn=fn: fn(*call))
                  for label, fn in (("bitsandbytes", reference.dequantize_4bit),
                                    ("graphopt", dequantize_4bit.dequantize_4bit))}
            for label in total:
                total[label] += us[label]
            gb_s = out_features * in_features * 2.5 / us["graphopt"] / 1e3
            print(f"| {shape} | {name} | {out_features} × {in_features} | {us['bitsandbytes']:.1f} | "
                  f"{us['graphopt']:.1f} | {us['bitsandbytes'] / us['graphopt']:.2f} | {gb_s:,.0f} | "
                  f"{differing} ({ulps}) |")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({
                        "shape": shape, "projection": name, "out": out_features, "in": in_features,
                        "bitsandbytes_us": us["bitsandbytes"], "graphopt_us": us["graphopt"],
                        "differing": differing, "max_ulp": ulps, "device_name": device_name(device),
                        "torch": torch.__version__, "triton": triton.__version__,
                        "bitsandbytes": version_of("bitsandbytes"),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}) + "\n")
        print(f"| {shape} | the layer | | {total['bitsandbytes']:.1f} | {total['graphopt']:.1f} | "
              f"{total['bitsandbytes'] / total['graphopt']:.2f} | | |")


if __name__ == "__main__":
    main()
