"""Compile every Triton kernel of graphopt/kernels ahead of time for one GPU target, on a machine without a GPU.

    python tests/aot_compile.py hip gfx942 64        (or: cuda 90 32)   → one JSON line per kernel launch

Each launch function of kernels/ runs on small CPU tensors with its kernels replaced by recorders, under the
platform the target implies (kernels/layout.py: "cuda", or the AMD arch's family) and the target's multiprocessor
count (MULTIPROCESSORS), so what compiles is exactly what that platform would launch: the kernel, its argument
types, its constexprs, num_warps and num_stages; each line also gives the grids it was launched with.
tests/test_aot.py runs this in a process of its own: Triton's interpreter (which the CPU tests use) must be off for
kernels to compile.
"""

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import KernelInterface

from graphopt.kernels import (cross_entropy, dequantize_4bit, gated_activation, layout, linear_logprobs, lora,
                              padded_attention, rmsnorm, rope)

# SMs or CUs of each target's GPU: H100/H200, A100, MI300X, RX 7900 XTX
MULTIPROCESSORS = {"90": 132, "80": 108, "gfx942": 304, "gfx1100": 96}
# fp16 on one target of each vendor: its kernels are bf16's with another element type, and each dtype costs CI
# a third of a target's compile time
FP16_TARGETS = {"90", "gfx942"}
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
           torch.int32: "*i32", torch.uint8: "*u8", torch.bool: "*i1"}
launches = []


def record(kernel, grid):  # kernel[grid](*args, **kwargs) records instead of launching
    return lambda *args, **kwargs: launches.append((kernel, grid, args, kwargs))


def signature(kernel, args, kwargs):
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion")
               if key in kwargs}
    values = dict(zip(kernel.arg_names, args)) | kwargs
    types, constexprs = {}, {}
    for param in kernel.params:
        name, value = param.name, values[param.name]
        if param.is_constexpr or value is None:
            types[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            types[name] = POINTER[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            types[name] = "fp32"
    return types, constexprs, options


def run_launch_functions(dtypes):
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    from bitsandbytes import functional as bnb_functional

    quantized = {nested: bnb_functional.quantize_4bit(randn(96, 200, dtype=torch.float32), blocksize=64,
                                                      quant_type="nf4", compress_statistics=nested)
                 for nested in (False, True)}
    for dtype in dtypes:
        for nested, (packed, state) in quantized.items():  # QLoRA's base: absmax double-quantized or not
            absmax = (state.state2.absmax, state.absmax, state.state2.code, state.offset) if nested else (
                state.absmax, None, None, None)
            dequantize_4bit.dequantize_4bit(packed, [96, 200], absmax[0], 64, "nf4", *absmax[1:], dtype)
        x, w = randn(64, 256, dtype=dtype), randn(256, dtype=dtype)
        rmsnorm.rms_norm_forward(x, w, 1e-6, 0.0, dtype)
        rmsnorm.rms_norm_backward(randn(64, 256, dtype=dtype), x, w, 1e-6, 0.0, True)
        gate, up = randn(64, 512, dtype=dtype), randn(64, 512, dtype=dtype)
        for activation in ("silu", "gelu_tanh"):
            gated_activation.gated_activation_forward(gate, up, activation)
            gated_activation.gated_activation_backward(randn(64, 512, dtype=dtype), gate, up, activation)
        q, k = randn(2, 8, 32, 64, dtype=dtype), randn(2, 2, 32, 64, dtype=dtype)
        cos, sin = randn(1, 32, 64, dtype=dtype), randn(1, 32, 64, dtype=dtype)
        rope.rope_forward(q, k, cos, sin)
        rope.rope_backward(q, k, cos, sin)
        # padded attention's token reordering (the flash kernels are aten's), both ways
        keep = torch.arange(32)[None, :] < torch.tensor([[32], [20]])
        order, bounds, _ = padded_attention._sequences(keep)
        padded_attention._unflat(padded_attention._flat(q, order, bounds), order, bounds, 2, 32)
        padded_attention._flat(k, order, bounds)
        lora_a, lora_b = randn(16, 256, dtype=torch.float32), randn(512, 16, dtype=torch.float32)
        weight = randn(512, 256, dtype=dtype)
        x = randn(64, 256, dtype=dtype)
        lora.lora_linear_forward(x, weight, None, lora_b, lora.lora_down_forward(x, lora_a), 2.0, dtype)
        lora.lora_linear_backward(randn(64, 512, dtype=dtype), randn(64, 256, dtype=dtype),
                                  randn(64, 16, dtype=torch.float32), weight, lora_a, lora_b, 2.0)
        hidden, lm_head = randn(64, 256, dtype=dtype), randn(1000, 256, dtype=dtype)
        target = torch.randint(0, 1000, (64,), generator=g)
        for softcap in (0.0, 30.0):
            cross_entropy.linear_cross_entropy(hidden, lm_head, None, target, -100, "mean", softcap, 32, True, False)
        # TRL's head with every statistic and softcapping; its backward with the entropy's gradient
        head = (hidden, lm_head, None, target, 0.7, 30.0, 1.0, dtype)
        linear_logprobs.linear_logprobs(*head, True, True, True, True, 32)
        per_row = randn(64, dtype=torch.float32)
        linear_logprobs.linear_logprobs_backward(per_row, per_row, *head[:4], per_row, per_row, *head[4:], 32, True,
                                                 True)


def main(backend, arch, warp_size):
    target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, int(warp_size))
    platform = "cuda" if backend == "cuda" else layout.amd_family(arch)
    KernelInterface.__getitem__ = record  # this process launches nothing
    layout.platform = lambda t: platform
    layout.multiprocessors = lambda device: MULTIPROCESSORS[arch]
    dtypes = (torch.bfloat16, torch.float32) + ((torch.float16,) if arch in FP16_TARGETS else ())
    run_launch_functions(dtypes)
    signatures, grids = {}, {}  # one compile per distinct signature, with every grid it was launched with
    for kernel, grid, args, kwargs in launches:
        types, constexprs, options = signature(kernel, args, kwargs)
        key = json.dumps([kernel.__name__, types, {k: repr(v) for k, v in constexprs.items()}, options])
        signatures[key] = kernel, types, constexprs, options
        grids.setdefault(key, set()).add(tuple(grid))
    for key, (kernel, types, constexprs, options) in signatures.items():
        binary = triton.compile(ASTSource(kernel, types, constexprs), target=target, options=options)
        assembly = binary.asm.get("amdgcn") or binary.asm.get("ptx") or ""
        print(json.dumps({
            "kernel": kernel.__name__, "platform": platform, "types": types,
            "constexprs": {k: repr(v) for k, v in constexprs.items()},
            "options": options, "threads": binary.metadata.num_warps * binary.metadata.warp_size,
            "grids": sorted(grids[key]), "binary": "hsaco" if backend == "hip" else "cubin",
            "binary_bytes": len(binary.asm.get("hsaco") or binary.asm.get("cubin") or b""),
            "instructions": sorted(i for i in ("mfma", "wmma", "wgmma", "mma.sync") if i in assembly)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
