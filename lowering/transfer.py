"""Saved activations to host memory and back, overlapped with compute: the bodies of graphopt::offload and
graphopt::reload (lowering/ops.py), which passes/offload.py inserts into the partitioned graphs.

On an accelerator every copy runs on one side stream per device, so the compute stream never waits for a copy
it does not need yet:
- offload: the side stream waits for the compute stream (the tensor is written), copies it into pinned host
  memory, and the tensor's device block is marked in use by the side stream (record_stream), so the caching
  allocator hands it out again only after the copy, without the compute stream waiting.
- reload: takes the copy a prefetch started (or starts it now), makes the compute stream wait for that copy
  only, then starts the prefetch of the tensors it was given (the next layer's), which run under this layer's
  backward compute. D2H and H2D copies share the side stream, so a reload is always ordered after its offload.
Pinned blocks come from torch's caching host allocator, which reuses them across steps once their copies are
done. On the CPU both are plain copies (the pipeline inserts them only for accelerators).
"""

import weakref

import torch

_side_streams = {}
# id(host tensor) → (weak reference to it, device tensor, copy-done event, prefetch batch)
_prefetched = {}
_batch = 0


def offload(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return x.clone(memory_format=torch.contiguous_format)
    compute, side = _streams(x.device)
    side.wait_stream(compute)
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    with side:
        host.copy_(x, non_blocking=True)
    x.record_stream(side)
    return host


def reload(host: torch.Tensor, device: torch.device, prefetch: list) -> torch.Tensor:
    if device.type == "cpu":
        return host.clone()
    entry = _prefetched.pop(id(host), None)
    if entry is not None and entry[0]() is host:
        _, result, done, _ = entry
    else:  # not prefetched (the first layer the backward reloads), or the prefetch went stale
        result, done = _copy_in(host, device)
    torch.accelerator.current_stream(device).wait_event(done)
    if prefetch:
        _start_prefetch(prefetch, device)
    return result


def _start_prefetch(hosts, device):
    global _batch
    _batch += 1
    # A prefetch still pending from two batches ago was never reloaded (a backward abandoned midway, or a graph
    # whose reload order changed): drop it, so at most two layers' copies are ever held.
    for key in [k for k, entry in _prefetched.items() if entry[3] < _batch - 1]:
        del _prefetched[key]
    for host in hosts:
        result, done = _copy_in(host, device)
        _prefetched[id(host)] = (weakref.ref(host), result, done, _batch)


def _copy_in(host, device):
    compute, side = _streams(device)
    result = torch.empty(host.shape, dtype=host.dtype, device=device)  # a block of the compute stream
    side.wait_stream(compute)  # which may still be using that block: copy into it only after
    with side:
        result.copy_(host, non_blocking=True)
    return result, side.record_event()


def _streams(device):
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    if device not in _side_streams:
        _side_streams[device] = torch.Stream(device=device)
    return torch.accelerator.current_stream(device), _side_streams[device]

