"""QLoRA's base dequantization, one decoder layer's seven projections: bitsandbytes' ops (two launches for a
double-quantized weight: the absmax, then the weight) and Unsloth's Triton kernel (`unsloth/kernels/nf4.py`, where
Unsloth is importable) against graphopt's one Triton launch (kernels/dequantize_4bit.py), NF4 with double
quantization, block 64, into bf16. GPU time per call from inside a CUDA graph (`triton.testing.do_bench_cudagraph`:
as the train step replays them, launch costs gone), and the bytes each call moves (½ byte read and 2 written an
element) over that time; graphopt's output against bitsandbytes' (elements that differ, and by at most how many
units in the last place). --sweep times graphopt's kernel per layer over bytes a program and warps instead, the
launch settings kernels/dequantize_4bit.py: CONFIGS holds.

    python benchmarks/dequantize_4bit.py --shape 1b [--shape 8b] [--json results.jsonl] [--sweep]
"""

import argparse
import datetime
import itertools
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
    """graphopt's arguments (those of kernels/reference.py: dequantize_4bit) and bitsandbytes' quant state."""
    from bitsandbytes import functional as bnb_functional

    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    return (packed, [out_features, in_features], state.state2.absmax, 64, "nf4", state.absmax, state.state2.code,
            state.offset, torch.bfloat16), state


def unsloth_dequantize():
    """Unsloth's NF4 kernel as a function of graphopt's arguments and the quant state, or None without Unsloth."""
    try:
        import unsloth  # noqa: F401  (its package import sets up what its kernels import)
        from unsloth.kernels.nf4 import dequantize_nf4
    except ImportError:
        return None

    def dequantize(call, state):
        packed, shape, nested_absmax, blocksize, _, absmax_8bit, absmax_code, offset, dtype = call
        return dequantize_nf4(packed, absmax_8bit, absmax_code, nested_absmax, offset, state.code, blocksize,
                              state.state2.blocksize, shape, dtype)

    return dequantize


def ulps_apart(a, b):
    """(elements that differ, the most units in the last place between two bf16 tensors)."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia, ib = (torch.where(i < 0, -32768 - i, i) for i in (ia, ib))  # sign-magnitude → ordered integers
    return int((ia != ib).sum()), int((ia - ib).abs().max())


def gpu_us(fn, *args):
    return 1000 * triton.testing.do_bench_cudagraph(lambda: fn(*args))


def compare(shapes, path):
    """The table of the module docstring: each projection, then the layer."""
    unsloth = unsloth_dequantize()
    print("| shape | projection | [out × in] | bitsandbytes µs | Unsloth µs | graphopt µs | ×bitsandbytes | ×Unsloth "
          "| graphopt GB/s | differing (max ulp) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in shapes:
        total = {"bitsandbytes": 0.0, "unsloth": 0.0, "graphopt": 0.0}
        for name, (out_features, in_features) in projections(shape).items():
            call, state = quantized(out_features, in_features)
            differing, ulps = ulps_apart(dequantize_4bit.dequantize_4bit(*call), reference.dequantize_4bit(*call))
            us = {"bitsandbytes": gpu_us(reference.dequantize_4bit, *call),
                  "unsloth": gpu_us(unsloth, call, state) if unsloth else float("nan"),
                  "graphopt": gpu_us(dequantize_4bit.dequantize_4bit, *call)}
            for label in total:
                total[label] += us[label]
            gb_s = out_features * in_features * 2.5 / us["graphopt"] / 1e3
            print(f"| {shape} | {name} | {out_features} × {in_features} | {us['bitsandbytes']:.1f} | "
                  f"{us['unsloth']:.1f} | {us['graphopt']:.1f} | {us['bitsandbytes'] / us['graphopt']:.2f} | "
                  f"{us['unsloth'] / us['graphopt']:.2f} | {gb_s:,.0f} | {differing} ({ulps}) |")
            if path:
                with open(path, "a") as f:
                    f.write(json.dumps({
                        "shape": shape, "projection": name, "out": out_features, "in": in_features,
                        "bitsandbytes_us": us["bitsandbytes"], "unsloth_us": us["unsloth"] if unsloth else None,
                        "graphopt_us": us["graphopt"], "graphopt_config": dequantize_4bit.CONFIGS["cuda"],
                        "differing": differing, "max_ulp": ulps, "device_name": device_name(torch.device("cuda")),
                        "torch": torch.__version__, "triton": triton.__version__,
                        "bitsandbytes": version_of("bitsandbytes"), "unsloth": version_of("unsloth"),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}) + "\n")
        print(f"| {shape} | the layer | | {total['bitsandbytes']:.1f} | {total['unsloth']:.1f} | "
              f"{total['graphopt']:.1f} | {total['bitsandbytes'] / total['graphopt']:.2f} | "
              f"{total['unsloth'] / total['graphopt']:.2f} | | |")


def sweep(shapes):
    """graphopt's kernel, µs per layer, under each launch setting; CONFIGS is left as it was."""
    kept = dict(dequantize_4bit.CONFIGS["cuda"])
    settings = list(itertools.product((256, 512, 1024, 2048, 4096), (1, 2, 4, 8)))
    print("| shape | " + " | ".join(f"{b} B, {w} warps" for b, w in settings) + " |")
    print("| --- |" + " ---: |" * len(settings))
    try:
        for shape in shapes:
            calls = [quantized(*dims)[0] for dims in projections(shape).values()]
            row = []
            for byte_count, warps in settings:
                dequantize_4bit.CONFIGS["cuda"] = dict(BYTES=byte_count, num_warps=warps)
                row.append(sum(gpu_us(dequantize_4bit.dequantize_4bit, *call) for call in calls))
            print(f"| {shape} | " + " | ".join(f"{us:.1f}" for us in row) + " |")
    finally:
        dequantize_4bit.CONFIGS["cuda"] = kept


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per shape and projection")
    parser.add_argument("--sweep", action="store_true", help="time graphopt's kernel over its launch settings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dequantize_4bit.py measures CUDA kernels: no GPU here")
    shapes = args.shape or ["1b"]
    if args.sweep:
        sweep(shapes)
    else:
        compare(shapes, args.json)


if __name__ == "__main__":
    main()
