"""What both benchmark scripts record about the machine they ran on."""

import platform
from importlib import metadata

import torch


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def version_of(package):
    """The installed version, or None where the package is absent (triton on some CPU machines)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
