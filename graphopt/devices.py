"""Which target a graph runs on: detected from its tensors, or checked when the user names one."""

import torch

from graphopt.options import OptionError


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
