"""`graphopt doctor`: device detection (faked devices), versions as installed, every op self-tested, and a wrong
or failing op reported as unavailable with a non-zero exit. Also the kernels' launch platform of a faked device."""

import importlib.metadata
import io
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from graphopt import devices, doctor
from graphopt.kernels import layout, reference
from graphopt.lowering import ops

OP_NAMES = {op._opname for op in ops.ALL_OPS} | {"offload/reload"}


def doctor_output():
    out = io.StringIO()
    status = doctor.run(stream=out)
    return status, out.getvalue()


def table(text):
    rows = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=2)
        if parts and parts[0] in OP_NAMES:
            rows[parts[0]] = parts[1]
    return rows


def test_doctor_tests_every_op_on_this_machine():
    graphs_before = dict(counters["stats"]), sum(counters["inductor"].values())
    status, text = doctor_output()
    assert (dict(counters["stats"]), sum(counters["inductor"].values())) == graphs_before  # eager calls only
    assert status == 0, text
    assert table(text) == {name: "supported" for name in OP_NAMES}
    assert f"device: {devices.detect().describe()}" in text
    for package in ("torch", "transformers", "peft"):
        assert f"{package} {importlib.metadata.version(package)}" in text
    assert "distributed: one process (no torch.distributed process group)" in text


def test_doctor_names_the_launchers_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert "distributed: rank 1 of 2 by the launcher's environment" in doctor_output()[1]


def test_wrong_numbers_make_an_op_unavailable(monkeypatch):
    # the doctor's fp64 reference disagrees with what the op computes, as a broken kernel would with it
    wrong = SimpleNamespace(**{**vars(reference), "rms_norm": lambda *args: 2 * reference.rms_norm(*args)})
    monkeypatch.setattr(doctor, "reference", wrong)
    status, text = doctor_output()
    assert status == 1 and table(text)["rms_norm"] == "unavailable" and "wrong numbers" in text
    assert "1 op(s) unavailable: rms_norm" in text


def test_a_failing_op_is_unavailable_and_named(monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(reference, "rope_backward", broken)
    status, text = doctor_output()
    assert status == 1 and table(text)["rope_backward"] == "unavailable"
    assert "RuntimeError: no kernel for this device" in text



def fake_gpu(monkeypatch, hip, name, major=9, minor=0, arch=""):
    props = SimpleNamespace(name=name, major=major, minor=minor, total_memory=141 * 2**30, gcnArchName=arch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)


def test_detects_cuda_with_its_compute_capability(monkeypatch):
    fake_gpu(monkeypatch, None, "NVIDIA H200")
    device = devices.detect()
    assert (device.target, device.arch, device.memory_bytes, device.bf16) == ("cuda", "sm_90", 141 * 2**30, True)
    assert device.torch_device == torch.device("cuda")


def test_detects_rocm_with_its_gfx_arch(monkeypatch):
    fake_gpu(monkeypatch, "6.2.41133", "AMD Instinct MI300X", arch="gfx942:sramecc+:xnack-")
    device = devices.detect()
    assert (device.target, device.arch) == ("hip", "gfx942")
    assert device.torch_device == torch.device("cuda")  # ROCm's GPUs are cuda devices to torch


@pytest.fixture
def fresh_platforms():  # platform() reads a device's arch once; each test fakes another
    layout._amd_family.cache_clear()
    yield
    layout._amd_family.cache_clear()


@pytest.mark.parametrize("arch, family", [
    ("gfx942:sramecc+:xnack-", "cdna"), ("gfx90a:sramecc+:xnack-", "cdna"), ("gfx908", "cdna"), ("gfx1100", "rdna"),
    ("gfx1201", "rdna"),
    ("gfx960", "cdna"), ("gfx1300", "rdna"), ("", "rdna"),  # unknown to graphopt: by the gfx number's wave size
])
def test_rocm_gpus_take_their_familys_launch_settings(monkeypatch, fresh_platforms, arch, family):
    fake_gpu(monkeypatch, "6.2.41133", "AMD GPU", arch=arch)
    gpu_tensor = SimpleNamespace(device=torch.device("cuda", 0))  # platform() reads only the device
    assert layout.platform(gpu_tensor) == family
    assert layout.num_warps(gpu_tensor, 16) == (8 if family == "cdna" else 16)  # NVIDIA's threads per program
    assert layout.num_warps(gpu_tensor, 1) == 1


def test_nvidia_gpus_and_the_cpu_keep_their_launch_settings(monkeypatch, fresh_platforms):
    fake_gpu(monkeypatch, None, "NVIDIA H200")
    gpu_tensor = SimpleNamespace(device=torch.device("cuda", 0))
    assert (layout.platform(gpu_tensor), layout.num_warps(gpu_tensor, 4)) == ("cuda", 4)
    assert (layout.platform(torch.ones(1)), layout.num_warps(torch.ones(1), 4)) == ("cpu", 4)


def test_detects_mps_when_there_is_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "_npu_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert devices.detect().target == "mps"


def test_falls_back_to_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "_npu_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    device = devices.detect()
    assert device.target == "cpu" and device.memory_bytes > 0


@pytest.mark.parametrize("installed", [False, True], ids=["absent", "broken (no CANN)"])
def test_torch_npu_absent_or_broken_is_no_npu(installed, monkeypatch):
    find_spec = devices.importlib.util.find_spec
    monkeypatch.setattr(devices.importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "torch_npu"
                        else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # importing it raises, as without CANN
    assert devices._npu_available() is False


def test_command_line_doctor_is_quick():
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "graphopt", "doctor"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every op runs on this device" in run.stdout
    # the self-test compiles nothing (test above); the bound is the import's and the eager calls' on a slow 2-core
    # machine with the suite's other worker busy (47 s measured there, 10 s of it importing graphopt)
    assert time.perf_counter() - start < 90
