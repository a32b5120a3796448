"""Which target a graph runs on: detected from its tensors, or checked when the user names one; and what this
machine has (detect(), for `graphopt doctor`)."""

import importlib.util
import os
import platform
from dataclasses import dataclass
from typing import Optional

import torch

from graphopt.options import OptionError


@dataclass(frozen=True)
class Device:
    """The machine's best device for graphopt, and what graphopt needs to know of it."""

    target: str  # cuda | hip | npu | mps | xpu | cpu
    name: str
    arch: str  # sm_90, gfx942, ... ("" where there is no such name)
    memory_bytes: Optional[int]
    bf16: bool

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.target in ("cuda", "hip") else self.target)

    def describe(self) -> str:
        memory = f", {self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else ""
        arch = f", {self.arch}" if self.arch else ""
        return f"{self.name} (target {self.target}{arch}{memory}, bf16 {'yes' if self.bf16 else 'no'})"


def _npu_available() -> bool:
    # torch_npu without CANN breaks at import (DESIGN.md): look for it first, and treat any import failure as absent
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:  # a broken CANN install surfaces as assorted errors
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def gfx_arch(props) -> str:
    """A ROCm device's architecture from its torch.cuda.get_device_properties(): gcnArchName without the feature
    flags ("gfx942:sramecc+:xnack-" → "gfx942"); "" where torch gives none."""
    return getattr(props, "gcnArchName", "").split(":")[0]


def detect() -> Device:
    """The first accelerator torch can use (CUDA or ROCm, Ascend NPU, Apple MPS, Intel XPU), else the CPU."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if torch.version.hip:
            return Device("hip", props.name, gfx_arch(props), props.total_memory, torch.cuda.is_bf16_supported())
        return Device("cuda", props.name, f"sm_{props.major}{props.minor}", props.total_memory,
                      torch.cuda.is_bf16_supported())
    if _npu_available():
        return Device("npu", torch.npu.get_device_name(0), "", None, True)
    if torch.backends.mps.is_available():
        return Device("mps", "Apple GPU (MPS)", "", None, True)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return Device("xpu", torch.xpu.get_device_name(0), "", None, True)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return Device("cpu", f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "", memory, True)


def device_target(device: torch.device) -> str:
    if device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    if device.type in ("mps", "npu", "cpu"):
        return device.type
    return device.type  # xpu and others: no lowering of their own yet


def resolve_target(requested: str, example_inputs) -> str:
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    found = {device_target(d) for d in devices}
    if len(found) > 1:
        # Scalars on CPU beside GPU tensors are common; the accelerator decides.
        found.discard("cpu")
    if len(found) > 1:
        raise OptionError(f"the graph's inputs live on several device types {sorted(found)}; "
                          "graphopt compiles a graph for one target")
    detected = found.pop() if found else "cpu"
    if requested != "auto" and requested != detected:
        raise OptionError(f"target={requested!r} was requested but the model's tensors are on {detected!r}; "
                          f"move the model to that device or use target='auto'")
    return detected
