"""Every Triton kernel compiles ahead of time, without a GPU, for the GPUs graphopt targets: NVIDIA sm_80 and
sm_90 (cubin) and AMD gfx942 (MI300, CDNA) and gfx1100 (RDNA3) (hsaco), at the launch configurations each
platform would use, for bf16 and fp32 inputs, and fp16 on sm_90 and gfx942 (tests/aot_compile.py does the
compiling). The LoRA kernels' rank-r products must become the target's matrix instructions. AMD's settings
follow kernels/layout.py's rules: the family's (CDNA or RDNA) settings, NVIDIA's threads per program, 2 pipeline
stages; and the LoRA reduce fills the GPU with 4 programs per multiprocessor."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aot_compile import FP16_TARGETS, MULTIPROCESSORS
from graphopt.kernels import (cross_entropy, dequantize_4bit, gated_activation, linear_logprobs, lora,
                              padded_attention, rmsnorm, rope)

KERNELS = {name for module in (cross_entropy, dequantize_4bit, gated_activation, linear_logprobs, lora,
                               padded_attention, rmsnorm, rope)
           for name in vars(module) if name.endswith("_kernel")}
MATRIX_KERNELS = {"_project_kernel", "_reduce_rows_pair_kernel", "_add_low_rank_kernel"}
TARGETS = {  # target → (its platform, matrix instructions every LoRA kernel must use and the others may not)
    ("cuda", "90", "32"): ("cuda", {"wgmma", "mma.sync"}),
    ("cuda", "80", "32"): ("cuda", {"mma.sync"}),
    ("hip", "gfx942", "64"): ("cdna", {"mfma"}),
    ("hip", "gfx1100", "32"): ("rdna", {"wmma"}),
}
IDS = ["sm_90", "sm_80", "gfx942", "gfx1100"]
AMD_TARGETS = [target for target in TARGETS if target[0] == "hip"]
SM_90 = ("cuda", "90", "32")


@functools.cache  # each target compiles once for all the tests that read it
def compile_for(target):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    script = Path(__file__).with_name("aot_compile.py")
    run = subprocess.run([sys.executable, str(script), *target], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.mark.parametrize("target", list(TARGETS), ids=IDS)
def test_every_kernel_compiles_for_the_target(target):
    compiled = compile_for(target)
    assert {c["kernel"] for c in compiled} == KERNELS
    assert all(c["binary"] == ("hsaco" if target[0] == "hip" else "cubin") and c["binary_bytes"] > 0
               for c in compiled)
    platform, expected = TARGETS[target]
    assert all(c["platform"] == platform for c in compiled)
    for c in compiled:
        found = set(c["instructions"])
        if c["kernel"] in MATRIX_KERNELS:
            assert found and found <= expected, c
        else:
            assert not found, c
    if target[:2] == ("cuda", "90"):  # Hopper's warpgroup MMA where a row block of 64 meets rank 16
        assert all("wgmma" in c["instructions"] for c in compiled
                   if c["kernel"] in ("_project_kernel", "_add_low_rank_kernel"))
    if target[0] == "hip":  # 2 pipeline stages, given where a loop feeds tl.dot, else Triton's AMD default
        assert all(c["options"].get("num_stages", 2) == 2 for c in compiled)
        assert all(c["options"]["num_stages"] == 2 for c in compiled
                   if c["kernel"] in ("_project_kernel", "_reduce_rows_pair_kernel"))


def threads_per_launch(compiled):
    """Threads per program of each compiled launch, keyed by kernel, argument types and constexprs; the dot
    precision aside, which differs between NVIDIA and AMD by design."""
    return {json.dumps([c["kernel"], c["types"], {k: v for k, v in c["constexprs"].items() if k != "PRECISION"}]):
            c["threads"] for c in compiled}


@pytest.mark.parametrize("target", AMD_TARGETS, ids=[IDS[list(TARGETS).index(t)] for t in AMD_TARGETS])
def test_programs_have_the_threads_tuned_on_nvidia(target):
    # num_warps × the wave size (64 on CDNA, 32 on RDNA), from the compiled kernels' metadata
    # every launch sm_90 compiles, its fp16 ones where the target compiles fp16 too
    nvidia = threads_per_launch(compile_for(SM_90))
    expected = {k: v for k, v in nvidia.items() if target[1] in FP16_TARGETS or '"*fp16"' not in k}
    assert threads_per_launch(compile_for(target)) == expected


@pytest.mark.parametrize("target", list(TARGETS), ids=IDS)
def test_lora_reduce_fills_the_gpu(target):
    """The row reduction's splits follow the weights' sizes alone, not the token count (lowering/traced.py traces
    it over a symbolic one): 4 programs a multiprocessor, in whole splits over every column block."""
    grids = [(blocks, splits) for c in compile_for(target) if c["kernel"] == "_reduce_rows_pair_kernel"
             for blocks, splits in c["grids"]]
    fill = 4 * MULTIPROCESSORS[target[1]]
    assert grids and all(fill <= blocks * splits < fill + blocks for blocks, splits in grids), grids
