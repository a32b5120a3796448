"""What both benchmark scripts record about the machine they ran on."""

import platform
import time
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


def host_link_gib_s(device, mib=256, repeats=4):
    """{"d2h", "h2d"}: GiB/s of copies between the device and pinned host memory on a side stream, as offload
    makes them; None off CUDA. A step that offloads waits for its copies where they outlast the compute they
    overlap."""
    if device.type != "cuda":
        return None
    on_device = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream(device)
    rates = {}
    for name, copy in (("d2h", lambda: host.copy_(on_device, non_blocking=True)),
                       ("h2d", lambda: on_device.copy_(host, non_blocking=True))):
        with torch.cuda.stream(side):
            copy()  # the first copy pays for setting up the transfer
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for _ in range(repeats):
                copy()
        torch.cuda.synchronize(device)
        rates[name] = repeats * mib / 1024 / (time.perf_counter() - start)
    del on_device
    torch.cuda.empty_cache()  # the peak reserved is measured later: the probe's block must not count in it
    return rates


def launch_us(device, launches=5000):
    """Host microseconds per launch of a tiny kernel (torch's dispatch plus the driver's launch), the GPU idle
    otherwise; None off CUDA. A step that launches its kernels one by one (no CUDA graphs) waits on this where
    its kernels are short: the 1B lean step ran 0.71× to 1.23× Unsloth's speed across H200 hosts with the same
    copy bandwidth (benchmarks/RESULTS.md, ninth session)."""
    if device.type != "cuda":
        return None
    counter = torch.zeros(1, device=device)
    for _ in range(100):
        counter.add_(1)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(launches):
        counter.add_(1)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / launches * 1e6
