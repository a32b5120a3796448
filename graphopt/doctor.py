"""`graphopt doctor`: what this machine can run. The device, the versions that matter, how each graphopt op will
run there, and a self-test of every op on the device against kernels/reference.py in fp64. The test calls each
op eagerly: its kernel registered for the device (on CUDA the standalone Triton kernels, also of the ops that
compiled graphs hand to Inductor decomposed), at small shapes, in bf16 where the device has it, else fp32.

Each op is reported as
  supported    its lowering for this target ran on the device and matched the fp64 reference
  degraded     it ran and matched, but through the pure-torch reference (no fused kernel for this target)
  unavailable  it failed or did not match; the reason says which
Exit status 1 when any op is unavailable: a model that uses it would fail or train on wrong numbers.
"""

import importlib.metadata
import os
import sys
import time

import torch

from graphopt import distributed
from graphopt.devices import Device, detect
from graphopt.kernels import reference
from graphopt.lowering import registry

PACKAGES = ("torch", "triton", "transformers", "peft", "bitsandbytes", "torch_npu")
# Largest error relative to the reference's largest magnitude, by the dtype the op computed in
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
DEGRADED = "pure-torch reference"


def versions() -> dict:
    """Installed versions (read from package metadata: importing torch_npu without CANN breaks the process)."""
    found = {"python": sys.version.split()[0]}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    cann = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    if found["torch_npu"] or cann:
        found["CANN"] = cann or None
    return found


def _cases(device: torch.device, dtype: torch.dtype):
    """(op, its inputs on the device, the reference function) for every graphopt op, at small shapes."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    x, w = randn(8, 64), randn(64)
    gate, up = randn(8, 128), randn(8, 128)
    q, k, cos, sin = randn(1, 4, 8, 32), randn(1, 2, 8, 32), randn(1, 8, 32), randn(1, 8, 32)
    base, lora_a, lora_b = randn(32, 64), randn(4, 64, dtype=torch.float32), randn(32, 4, dtype=torch.float32)
    xa = x.float() @ lora_a.t()  # lora_down's x·Aᵀ, as lora_linear and its backward take it
    hidden, lm_head = randn(8, 64), randn(100, 64)
    target = torch.randint(0, 100, (8,), generator=g).to(device)
    d_hidden, d_weight = randn(8, 64, dtype=torch.float32), randn(100, 64, dtype=torch.float32)
    # TRL's head at temperature 0.7, softcap 30; is_top1 left out: a near tie may flip between dtypes
    head = (hidden, lm_head, None, target, 0.7, 30.0, 1.0, dtype)
    stats = reference.linear_logprobs(*head, True, True, True, False, 4)
    # attention over a batch without padding: the log-sum-exp's token order is then the same in every implementation;
    # packed, two documents under a sliding window of 3
    v, keep = randn(1, 2, 8, 32), torch.ones(1, 8, dtype=torch.bool, device=device)
    out, lse = reference.padded_attention(q, k, v, keep, 0.2)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]], device=device)
    packed_out, packed_lse = reference.packed_attention(q, k, v, positions, 0.2, 3)
    graphopt = torch.ops.graphopt
    return [
        (graphopt.rms_norm, (x, w, 1e-6, 0.0, dtype), reference.rms_norm),
        (graphopt.rms_norm_backward, (randn(8, 64), x, w, 1e-6, 0.0, True), reference.rms_norm_backward),
        (graphopt.gated_activation, (gate, up, "silu"), reference.gated_activation),
        (graphopt.gated_activation_backward, (randn(8, 128), gate, up, "silu"), reference.gated_activation_backward),
        (graphopt.rope, (q, k, cos, sin), reference.rope),
        (graphopt.rope_backward, (q, k, cos, sin), reference.rope_backward),
        (graphopt.lora_down, (x, lora_a), reference.lora_down),
        (graphopt.lora_linear, (x, base, None, lora_a, lora_b, xa, 2.0, dtype), reference.lora_linear),
        (graphopt.lora_linear_backward, (randn(8, 32), x, xa, base, lora_a, lora_b, 2.0),
         reference.lora_linear_backward),
        (graphopt.linear_cross_entropy, (hidden, lm_head, None, target, -100, "mean", 0.0, 4, True, True),
         reference.linear_cross_entropy),
        (graphopt.linear_cross_entropy_backward, (randn(()), d_hidden, d_weight),
         reference.linear_cross_entropy_backward),
        (graphopt.linear_logprobs, (*head, True, True, True, False, 4), reference.linear_logprobs),
        (graphopt.linear_logprobs_backward, (randn(8, dtype=torch.float32), randn(8, dtype=torch.float32), *head[:4],
                                             stats[5], stats[1], *head[4:], 4, True, True),
         reference.linear_logprobs_backward),
        (graphopt.padded_attention, (q, k, v, keep, 0.2), reference.padded_attention),
        (graphopt.padded_attention_backward, (randn(1, 4, 8, 32), q, k, v, keep, out, lse, 0.2),
         reference.padded_attention_backward),
        (graphopt.packed_attention, (q, k, v, positions, 0.2, 3), reference.packed_attention),
        (graphopt.packed_attention_backward, (randn(1, 4, 8, 32), q, k, v, positions, packed_out, packed_lse, 0.2, 3),
         reference.packed_attention_backward),
        *_4bit_cases(randn, x, xa, lora_a, lora_b, dtype),
    ]


def _4bit_cases(randn, x, xa, lora_a, lora_b, dtype):
    """lora_linear_4bit and its backward on a weight bitsandbytes quantizes (NF4, double quantization), checked
    against lora_linear's reference on the weight bitsandbytes dequantizes; without bitsandbytes, the reason."""
    graphopt = torch.ops.graphopt
    try:
        from bitsandbytes import functional as bnb
    except ImportError as missing:
        return [(op, None, f"bitsandbytes does not import ({missing}): QLoRA bases need it")
                for op in (graphopt.lora_linear_4bit, graphopt.lora_linear_4bit_backward)]
    packed, state = bnb.quantize_4bit(randn(32, 64), blocksize=64, quant_type="nf4", compress_statistics=True)
    base = (packed, [32, 64], state.state2.absmax, 64, "nf4")
    nested = (state.absmax, state.state2.code, state.offset)
    weight = bnb.dequantize_4bit(packed, state).to(dtype)

    def forward(x, *args):  # args end with lora_a, lora_b, xa, scaling, out_dtype
        return reference.lora_linear(x, weight.to(x), None, *args[-5:])

    def backward(grad, x, xa, *args):  # args end with lora_a, lora_b, scaling
        return reference.lora_linear_backward(grad, x, xa, weight.to(x), *args[-3:])

    return [(graphopt.lora_linear_4bit, (x, *base, None, *nested, lora_a, lora_b, xa, 2.0, dtype), forward),
            (graphopt.lora_linear_4bit_backward, (randn(8, 32), x, xa, *base, *nested, lora_a, lora_b, 2.0),
             backward)]


def _flat(value):
    return [t for t in (value if isinstance(value, (tuple, list)) else [value]) if t.numel()]


def _in_fp64(arg):
    if isinstance(arg, torch.Tensor):
        arg = arg.detach().cpu()
        return arg.double() if arg.is_floating_point() else arg
    return torch.float64 if isinstance(arg, torch.dtype) else arg


def _error(got, want) -> float:
    got, want = got.detach().cpu().double(), want.double()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def self_test(device: Device, dtype: torch.dtype, lowering) -> list:
    """[(op name, status, detail)] for every graphopt op, run on the device."""
    rows = []
    for op, args, fn in _cases(device.torch_device, dtype):
        name = op._qualified_op_name.split("::")[1]
        implementation = lowering.implementations.get(op.default, DEGRADED)
        if args is None:  # what the op needs is missing: fn says what
            rows.append((name, "unavailable", fn))
            continue
        try:
            got = _flat(op(*args))
            want = _flat(fn(*[_in_fp64(a) for a in args]))
            error = max((_error(a, b) for a, b in zip(got, want, strict=True)), default=0.0)
        except Exception as failure:  # the report names it; the doctor itself must finish
            rows.append((name, "unavailable", f"{type(failure).__name__}: {str(failure).splitlines()[0][:120]}"))
            continue
        if not error <= TOLERANCE[dtype]:
            rows.append((name, "unavailable", f"wrong numbers: error {error:.1e} > {TOLERANCE[dtype]:.0e} ({dtype})"))
        else:
            status = "degraded" if DEGRADED in implementation else "supported"
            rows.append((name, status, f"error {error:.1e} ({str(dtype).replace('torch.', '')}); {implementation}"))
    rows.append(_transfer_test(device))
    return rows


def _transfer_test(device: Device):
    x = torch.randn(64, 64, device=device.torch_device)
    try:
        token = torch.ops.graphopt.offload(x, [], [], True)
        back = torch.ops.graphopt.reload(token, list(x.shape), x.dtype, device.torch_device, [])
        same = torch.equal(back, x)
    except Exception as failure:
        return "offload/reload", "unavailable", f"{type(failure).__name__}: {str(failure).splitlines()[0][:120]}"
    copies = registry.lowering_for(device.target).offload_copies
    detail = "pinned host memory, side stream" if copies else "plan reported only (activations are in host memory)"
    return ("offload/reload", "supported" if same else "unavailable",
            detail if same else "the copy came back different")


def run(stream=sys.stdout) -> int:
    start = time.perf_counter()
    device = detect()
    lowering = registry.lowering_for(device.target)
    dtype = torch.bfloat16 if device.bf16 and device.target != "cpu" else torch.float32
    print(f"graphopt doctor\n\ndevice: {device.describe()}", file=stream)
    print("versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions().items()), file=stream)
    print(f"distributed: {distributed.describe(None)}", file=stream)
    if lowering.note:
        print(f"lowering note: {lowering.note}", file=stream)
    rows = self_test(device, dtype, lowering)
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'op':<{width}}  {'status':<11}  detail", file=stream)
    for name, status, detail in rows:
        print(f"{name:<{width}}  {status:<11}  {detail}", file=stream)
    unavailable = [name for name, status, _ in rows if status == "unavailable"]
    verdict = (f"{len(unavailable)} op(s) unavailable: {', '.join(unavailable)}" if unavailable
               else "every op runs on this device")
    print(f"\n{verdict} ({time.perf_counter() - start:.1f} s)", file=stream)
    return 1 if unavailable else 0


def main(argv=None) -> None:
    sys.exit(run())
