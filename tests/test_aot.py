"""Every Triton kernel compiles ahead of time, without a GPU, for the GPUs graphopt targets: NVIDIA sm_80 and
sm_90 (cubin) and AMD gfx942 (MI300), gfx90a (MI250) and gfx1100 (RDNA3) (hsaco), at the launch configurations
each platform would use, for bf16, fp16 and fp32 inputs (tests/aot_compile.py does the compiling). The LoRA
kernels' rank-r products must become the target's matrix instructions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphopt.kernels import cross_entropy, gated_activation, lora, rmsnorm, rope

KERNELS = {name for module in (cross_entropy, gated_activation, lora, rmsnorm, rope) for name in vars(module)
           if name.endswith("_kernel")}
MATRIX_KERNELS = {"_project_kernel", "_project_pair_kernel", "_reduce_rows_pair_kernel", "_add_low_rank_kernel"}
TARGETS = {  # target → (matrix instructions every LoRA kernel must use, and those the other kernels may not)
    ("cuda", "90", "32"): {"wgmma", "mma.sync"},
    ("cuda", "80", "32"): {"mma.sync"},
    ("hip", "gfx942", "64"): {"mfma"},
    ("hip", "gfx90a", "64"): {"mfma"},
    ("hip", "gfx1100", "32"): {"wmma"},
}


@pytest.mark.parametrize("target", list(TARGETS), ids=["sm_90", "sm_80", "gfx942", "gfx90a", "gfx1100"])
def test_every_kernel_compiles_for_the_target(target):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    script = Path(__file__).with_name("aot_compile.py")
    run = subprocess.run([sys.executable, str(script), *target], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = [json.loads(line) for line in run.stdout.splitlines()]
    assert {c["kernel"] for c in compiled} == KERNELS
    assert all(c["binary"] == ("hsaco" if target[0] == "hip" else "cubin") and c["binary_bytes"] > 0
               for c in compiled)
    expected = TARGETS[target]
    for c in compiled:
        found = set(c["instructions"])
        if c["kernel"] in MATRIX_KERNELS:
            assert found and found <= expected, c
        else:
            assert not found, c
    if target[:2] == ("cuda", "90"):  # Hopper's warpgroup MMA where a row block of 64 meets rank 16
        assert all("wgmma" in c["instructions"] for c in compiled
                   if c["kernel"] in ("_project_kernel", "_project_pair_kernel", "_add_low_rank_kernel"))
