"""Per-op micro-benchmarks: each graphopt op against the same unfused subgraph, eager and under Inductor.

    python benchmarks/per_op.py                                   # all ops, Llama-3.2-1B shape, on the GPU
    python benchmarks/per_op.py --ops rms_norm --json results.jsonl
    python benchmarks/per_op.py --device cpu --tokens 256         # smoke test: CPU timings mean nothing

Ops, at the Llama-3.2-1B shape (tokens = 4 × 2048, hidden 2048, intermediate 8192, LoRA r=16), bf16 with
PEFT's fp32 adapters:
  rms_norm          weight * (x.float() * rsqrt(mean(x.float()², -1) + eps)).to(bf16); weight frozen
  gated_activation  silu(gate) * up
  lora_linear       linear(x, W) + linear(linear(x.float(), A), B) * scaling, cast to bf16; W frozen
  rope              HF's apply_rotary_pos_emb: q·cos + rotate_half(q)·sin and the same for k (32 q heads,
                    8 k heads, head_dim 64, q and k transposed views of the projections)
  linear_cross_entropy  cross_entropy(linear(h, W_lm_head).float(), labels), vocab 128256, 10% labels ignored;
                    W frozen (tied, as LoRA leaves it)
Variants, each timed forward + backward (torch.autograd.grad with a fixed random grad_out):
  eager        the unfused subgraph in plain PyTorch
  inductor     torch.compile of the unfused subgraph (default backend)
  graphopt-op  torch.ops.graphopt.<op> called eagerly with its registered backward: on CUDA the Triton kernels of
               lowering/cuda.py (rms_norm, gated_activation, rope, linear_cross_entropy), the reference matmuls
               for lora_linear
  graphopt     torch.compile(unfused, backend="graphopt"): what users get
Time: median GPU time over --reps runs (CUDA events), L2 flushed before each run, the GPU kept busy while Python
enqueues the run so launch overhead is not counted (inside a model the CPU runs ahead of the GPU). Memory: peak
allocated during one forward + backward minus what was allocated before it ("peak extra"), and what the forward
leaves alive for the backward, output included ("fwd live"). Numerics: output and gradients of every variant
against eager's, ‖a − b‖ / ‖b‖; above 2e-2 the script exits non-zero.
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from common import device_name, version_of
import torch.nn.functional as F

import graphopt  # registers torch.ops.graphopt.* (and on CUDA their Triton kernels); last_report()

HIDDEN, INTERMEDIATE, RANK = 2048, 8192, 16  # Llama-3.2-1B, LoRA r=16
Q_HEADS, KV_HEADS, HEAD_DIM, SEQ, VOCAB = 32, 8, 64, 2048, 128256
EPS = 1e-5
SCALING = 1.0
DTYPE, ADAPTER_DTYPE = torch.bfloat16, torch.float32
H200_GBPS = 4300  # measured copy bandwidth of the H200, the ceiling for memory-bound ops
MAX_REL_ERR = 2e-2  # bf16
VARIANTS = ("eager", "inductor", "graphopt-op", "graphopt")
OPS = ("rms_norm", "gated_activation", "lora_linear", "rope", "linear_cross_entropy")


# --- the unfused subgraphs, spelled as HF transformers and PEFT spell them ---------------------------------

def rms_norm(x, weight):
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def gated_activation(gate, up):
    return F.silu(gate) * up


class LoraLinear(torch.nn.Module):
    """PEFT's lora.Linear forward, one adapter, no dropout. The adapters sit in ModuleDicts named lora_A and
    lora_B as in PEFT, because graphopt's LoRA pass anchors on the linears traced inside a lora_B module."""

    def __init__(self, weight, lora_a, lora_b, scaling):
        super().__init__()
        self.base_layer = _linear(weight, requires_grad=False)  # frozen, as PEFT leaves it
        self.lora_A = torch.nn.ModuleDict({"default": _linear(lora_a)})
        self.lora_B = torch.nn.ModuleDict({"default": _linear(lora_b)})
        self.scaling = scaling

    def forward(self, x):
        lora_a, lora_b = self.lora_A["default"], self.lora_B["default"]
        result = self.base_layer(x)
        result = result + lora_b(lora_a(x.to(lora_a.weight.dtype))) * self.scaling
        return result.to(x.dtype)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def linear_cross_entropy(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


def _linear(weight, requires_grad=True):
    """A bias-free nn.Linear with this weight (its storage: the other variants read the same numbers)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=requires_grad)
    return linear


# --- one benchmark case per op -----------------------------------------------------------------------------

@dataclass
class Case:
    op: str
    shape: str  # for the table and the JSON lines
    inputs: tuple  # the arguments of `unfused` and `fused`
    wrt: tuple  # what gradients are taken for
    names: tuple  # of the outputs, then of each gradient
    grad_out: tuple  # one per output
    unfused: Callable
    fused: Callable  # the graphopt op, eagerly
    pattern: str  # the pattern name graphopt's report must show as fused
    bytes_moved: Optional[int] = None  # the least traffic forward + backward can do (memory-bound ops)
    flops: Optional[int] = None  # the matmul work of forward + backward (lora_linear)


def make_case(op, tokens, device):
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=DTYPE, scale=1.0, grad=False):
        t = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale
        return t.to(dtype).requires_grad_(grad)

    size = 2  # bytes per bf16 element
    if op == "rms_norm":
        x, weight = randn(tokens, HIDDEN, grad=True), 1 + randn(HIDDEN, scale=0.1)  # weight frozen
        fused = lambda x, w: torch.ops.graphopt.rms_norm(x, w, EPS, 0.0, DTYPE)  # noqa: E731
        # forward reads x and writes y; backward reads dy and x and writes dx (no dW: the weight is frozen)
        return Case(op, f"x [{tokens}, {HIDDEN}] bf16, weight frozen", (x, weight), (x,), ("out", "dx"),
                    (randn(tokens, HIDDEN),), rms_norm, fused, "rms_norm", bytes_moved=5 * tokens * HIDDEN * size)
    if op == "gated_activation":
        gate, up = randn(tokens, INTERMEDIATE, grad=True), randn(tokens, INTERMEDIATE, grad=True)
        fused = lambda gate, up: torch.ops.graphopt.gated_activation(gate, up, "silu")  # noqa: E731
        # forward reads gate, up and writes h; backward reads dh, gate, up and writes dgate, dup
        return Case(op, f"gate, up [{tokens}, {INTERMEDIATE}] bf16", (gate, up), (gate, up),
                    ("out", "dgate", "dup"), (randn(tokens, INTERMEDIATE),), gated_activation, fused, "swiglu",
                    bytes_moved=8 * tokens * INTERMEDIATE * size)
    if op == "lora_linear":
        # Random B (PEFT starts it at zero) so that every gradient is non-zero and the LoRA path counts.
        x = randn(tokens, HIDDEN, grad=True)
        weight = randn(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5)
        lora_a = randn(RANK, HIDDEN, dtype=ADAPTER_DTYPE, scale=HIDDEN ** -0.5, grad=True)
        lora_b = randn(HIDDEN, RANK, dtype=ADAPTER_DTYPE, scale=RANK ** -0.5, grad=True)
        module = LoraLinear(weight, lora_a, lora_b, SCALING)
        # nn.Parameter wraps a new tensor: take the module's own, so every variant differentiates the same leaves.
        weight, lora_a, lora_b = (module.base_layer.weight, module.lora_A["default"].weight,
                                  module.lora_B["default"].weight)
        def fused(x):  # the two ops the pass writes
            xa = torch.ops.graphopt.lora_down(x, lora_a)
            return torch.ops.graphopt.lora_linear(x, weight, None, lora_a, lora_b, xa, SCALING, DTYPE)
        n, h, o, r = tokens, HIDDEN, HIDDEN, RANK
        # forward: x·Wᵀ, x·Aᵀ, (xA)·Bᵀ; backward: dY·W, dY·B, (dY·B)·A, dA, dB (recomputation not counted)
        flops = 2 * (n * h * o + n * h * r + n * r * o) + 2 * (n * o * h + n * o * r + 2 * n * r * h + n * o * r)
        return Case(op, f"x [{tokens}, {h}] bf16, W [{o}, {h}] bf16 frozen, A [{r}, {h}] / B [{o}, {r}] fp32",
                    (x,), (x, lora_a, lora_b), ("out", "dx", "dA", "dB"), (randn(tokens, o),), module, fused,
                    "lora", flops=flops)
    if op == "rope":
        batch = max(1, tokens // SEQ)
        seq = tokens // batch
        # q and k as HF hands them over: [B, H, S, D] transposed views of the projections' [B, S, H·D] outputs
        q, k = (randn(batch, seq, n * HEAD_DIM, grad=True) for n in (Q_HEADS, KV_HEADS))
        q_heads, k_heads = (t.view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for t in (q, k))
        angles = torch.arange(seq, device=device)[:, None] * 10000.0 ** (
            -torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        angles = torch.cat((angles, angles), dim=-1)[None]
        cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
        fused = lambda q, k, cos, sin: torch.ops.graphopt.rope(q, k, cos, sin)  # noqa: E731
        n_elements = q.numel() + k.numel()
        # forward reads q, k and writes both outputs; backward reads both gradients and writes dq, dk
        return Case(op, f"q [{batch}, {Q_HEADS}, {seq}, {HEAD_DIM}], k [{batch}, {KV_HEADS}, {seq}, {HEAD_DIM}] "
                    "bf16, transposed views", (q_heads, k_heads, cos, sin), (q, k), ("q_out", "k_out", "dq", "dk"),
                    (randn(batch, Q_HEADS, seq, HEAD_DIM), randn(batch, KV_HEADS, seq, HEAD_DIM)), rope, fused, "rope",
                    bytes_moved=4 * n_elements * size)
    if op == "linear_cross_entropy":
        hidden = randn(tokens, HIDDEN, grad=True)
        weight = randn(VOCAB, HIDDEN, scale=HIDDEN ** -0.5)
        labels = torch.randint(0, VOCAB, (tokens,), generator=g, device=device)
        labels[torch.rand(tokens, generator=g, device=device) < 0.1] = -100
        chunk = max(1, (256 * 2**20) // (VOCAB * 4))  # passes/fuse_linear_ce.py's choice
        fused = lambda h, w, t: torch.ops.graphopt.linear_cross_entropy(  # noqa: E731
            h, w, None, t, -100, "mean", 0.0, chunk, True, False)[0]
        # forward: h·Wᵀ; backward: dlogits·W (the lm_head is frozen)
        return Case(op, f"hidden [{tokens}, {HIDDEN}] bf16, lm_head [{VOCAB}, {HIDDEN}] bf16 frozen",
                    (hidden, weight, labels), (hidden,), ("loss", "dh"), (torch.ones((), device=device),),
                    linear_cross_entropy, fused, "linear_cross_entropy", flops=2 * 2 * tokens * HIDDEN * VOCAB)
    raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")


def build(variant, case):
    if variant == "eager":
        return case.unfused
    if variant == "graphopt-op":
        return case.fused
    # A fresh Dynamo cache, so the second compile of the same code is not a recompilation of the first.
    torch._dynamo.reset()
    if variant == "inductor":
        return torch.compile(case.unfused, fullgraph=True)
    return torch.compile(case.unfused, backend="graphopt", fullgraph=True)


def fwd_bwd(fn, case):
    outs = _as_tuple(fn(*case.inputs))
    return (*outs, *torch.autograd.grad(outs, case.wrt, case.grad_out))


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# --- measurements ----------------------------------------------------------------------------------------

def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def relative_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def memory_mib(fn, case, device):
    """(peak extra, fwd live) in MiB for one forward + backward; None off CUDA."""
    if device.type != "cuda":
        return None, None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = _as_tuple(fn(*case.inputs))
    synchronize(device)
    fwd_live = torch.cuda.memory_allocated(device) - before  # output + what autograd saved for the backward
    grads = torch.autograd.grad(out, case.wrt, case.grad_out)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out, grads
    return peak / 2**20, fwd_live / 2**20


def time_ms(fn, case, device, reps):
    """Median milliseconds of one forward + backward."""
    step = lambda: fwd_bwd(fn, case)  # noqa: E731
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times), None

    # How long Python takes to enqueue one step: the GPU sleeps twice that before each timed run, so the
    # events time the kernels, not gaps left by launch overhead.
    synchronize(device)
    start = time.perf_counter()
    step()
    enqueue_ms = 1000 * (time.perf_counter() - start)
    synchronize(device)
    sleep_ms = max(0.2, 2 * enqueue_ms)
    cycles = int(sleep_ms * _sleep_cycles_per_ms(device))

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # larger than the H200's 50 MB L2
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    enqueue = []
    for i in range(reps):
        flush.zero_()  # every run reads its inputs from HBM, as it would inside a model
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        starts[i].record()
        step()
        ends[i].record()
        enqueue.append(1000 * (time.perf_counter() - t0))
    synchronize(device)
    note = None
    if statistics.median(enqueue) > 0.8 * sleep_ms:
        note = (f"enqueueing took {statistics.median(enqueue):.3f} ms against a {sleep_ms:.3f} ms sleep: "
                "the time may include launch gaps")
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), note


_CYCLES_PER_MS = {}


def _sleep_cycles_per_ms(device):
    if device not in _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # first call loads the kernel
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        synchronize(device)
        _CYCLES_PER_MS[device] = 10_000_000 / start.elapsed_time(end)
    return _CYCLES_PER_MS[device]


def check_fused(case):
    """The graphopt variant must have fused the op; otherwise its row is plain Inductor and says nothing."""
    report = graphopt.last_report()
    counts = report.summary()
    if counts.get(case.pattern, 0) < 1:
        misses = "; ".join(f"{m.pattern}: {m.reason}" for m in report.misses) or "none"
        raise RuntimeError(f"graphopt did not fuse {case.pattern} (fusions {counts}, misses: {misses})")
    return counts


def run_variant(variant, case, reference, device, args):
    fn = build(variant, case)
    for _ in range(args.warmup):  # compiles forward and backward, fills the allocator's cache
        fwd_bwd(fn, case)
    synchronize(device)
    notes = []
    if variant == "graphopt":
        notes.append(f"graphopt fused {check_fused(case)}")

    # Checked once; eager's own results become the reference of the variants after it.
    results = [t.detach() for t in fwd_bwd(fn, case)]
    reference = results if reference is None else reference
    errors = {name: relative_error(got, want) for name, got, want in zip(case.names, results, reference)}
    del results

    peak_mib, live_mib = memory_mib(fn, case, device)
    ms, timing_note = time_ms(fn, case, device, args.reps)
    notes += [timing_note] if timing_note else []
    row = dict(variant=variant, ms=ms, peak_mib=peak_mib, fwd_live_mib=live_mib,
               rel_err=max(errors.values()), rel_errs=errors, notes=notes)
    if case.bytes_moved:
        row["gbps"] = case.bytes_moved / ms / 1e6
    if case.flops:
        row["tflops"] = case.flops / ms / 1e9
    return row, reference


# --- output ----------------------------------------------------------------------------------------------



def _num(value, digits):
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def _speedup(base, ms):
    return "—" if base is None or ms is None else f"{base / ms:.2f}×"


def print_table(case, rows, device):
    ok = {r["variant"]: r for r in rows if "error" not in r}
    eager, inductor = ok.get("eager", {}).get("ms"), ok.get("inductor", {}).get("ms")
    rate = "GB/s (% of 4.3 TB/s)" if case.bytes_moved else "TFLOP/s"
    print(f"\n### {case.op}: {case.shape}, {device_name(device)}\n")
    if case.bytes_moved:
        print(f"forward + backward move at least {case.bytes_moved / 1e6:,.0f} MB: "
              f"{case.bytes_moved / H200_GBPS / 1e6:.3f} ms at {H200_GBPS / 1000} TB/s\n")
    else:
        print(f"forward + backward: {case.flops / 1e9:,.1f} GFLOP of matmuls\n")
    print(f"| variant | fwd+bwd ms | ×eager | ×inductor | {rate} | peak extra MiB | fwd live MiB | rel err |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        if case.bytes_moved:
            speed = f"{r['gbps']:,.0f} ({100 * r['gbps'] / H200_GBPS:.0f}%)"
        else:
            speed = _num(r["tflops"], 1)
        print(f"| {r['variant']} | {r['ms']:.3f} | {_speedup(eager, r['ms'])} | {_speedup(inductor, r['ms'])} "
              f"| {speed} | {_num(r['peak_mib'], 1)} | {_num(r['fwd_live_mib'], 1)} | {r['rel_err']:.2e} |")
    print("\n×eager, ×inductor: their time / this time (> 1 is faster). rel err: the largest of output and "
          "gradients against eager's.")
    for r in rows:
        for note in r.get("notes", []):
            print(f"- {r['variant']}: {note}")


def json_line(case, row, args, device):
    return {
        "op": case.op, "variant": row["variant"], "ms": row.get("ms"), "peak_mib": row.get("peak_mib"),
        "fwd_live_mib": row.get("fwd_live_mib"), "rel_err": row.get("rel_err"), "rel_errs": row.get("rel_errs"),
        "gbps": row.get("gbps"), "tflops": row.get("tflops"), "error": row.get("error"),
        "tokens": args.tokens, "shape": case.shape, "dtype": "bf16", "adapter_dtype": "fp32",
        "device": device.type, "device_name": device_name(device), "reps": args.reps,
        "torch": torch.__version__, "triton": version_of("triton"), "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    parser.add_argument("--tokens", type=int, default=4 * 2048, help="rows: batch × sequence (default 8192)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per op and variant to PATH")
    parser.add_argument("--reps", type=int, help="timed runs per variant (default 100 on CUDA, 3 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed runs first, where compilation happens "
                                                   "(default 3 on CUDA, 1 on CPU)")
    args = parser.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if unknown := [op for op in args.ops if op not in OPS]:
        parser.error(f"unknown ops {unknown}; ops: {', '.join(OPS)}")
    if args.reps is None:
        args.reps = 100 if args.device == "cuda" else 3
    if args.warmup is None:
        args.warmup = 3 if args.device == "cuda" else 1
    if args.reps < 1 or args.warmup < 1 or args.tokens < 1:
        parser.error("--reps, --warmup and --tokens must be at least 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    print(f"torch {torch.__version__}, triton {version_of('triton')}, {device_name(device)}, "
          f"tokens {args.tokens}, {args.reps} timed runs after {args.warmup} warm-up runs", file=sys.stderr)
    if device.type == "cpu":
        print("note: on cpu the Triton kernels are skipped (they need CUDA, or TRITON_INTERPRET=1); graphopt-op "
              "runs the op's pure-torch reference body, graphopt its CPU lowering. CPU timings mean nothing.",
              file=sys.stderr)

    failures = []
    for op in args.ops:
        case = make_case(op, args.tokens, device)
        rows, reference = [], None
        for variant in VARIANTS:
            print(f"{op} / {variant} ...", file=sys.stderr, flush=True)
            if variant != "eager" and reference is None:
                rows.append(dict(variant=variant, error="no eager reference to check against"))
                failures.append(f"{op} / {variant}: skipped, eager failed")
                continue
            try:
                row, reference = run_variant(variant, case, reference, device, args)
            except Exception as error:  # one broken variant must not hide the others' numbers
                traceback.print_exc()
                row = dict(variant=variant, error=f"{type(error).__name__}: {error}")
                failures.append(f"{op} / {variant}: {row['error']}")
            else:
                if not row["rel_err"] <= MAX_REL_ERR:  # also catches NaN
                    failures.append(f"{op} / {variant}: rel err {row['rel_errs']} > {MAX_REL_ERR}")
                    row["notes"].append(f"FAIL: rel err {row['rel_errs']} > {MAX_REL_ERR}")
            rows.append(row)
            synchronize(device)
        print_table(case, rows, device)
        if args.json:
            with open(args.json, "a") as f:
                for row in rows:
                    f.write(json.dumps(json_line(case, row, args, device)) + "\n")
        del case, rows, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if failures:
        print("\nFAILED:\n" + "\n".join(f"- {f}" for f in failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
