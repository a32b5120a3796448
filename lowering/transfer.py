"""Saved activations to host memory and back, overlapped with compute: the bodies of graphopt::offload and
graphopt::reload (lowering/ops.py), which passes/offload.py inserts into the partitioned graphs.

Both run the same way eagerly and under CUDA graph capture, so Inductor captures them with the rest of the step:
- No host tensor crosses a graph's boundary. The forward saves a token for each offloaded tensor, a one-byte
  tensor on its device, and the host copy lives here, found by the token's address.
- Host buffers are pinned once and reused: an offload takes a free buffer of its shape and dtype, or pins a new
  one; a reload gives it back. Under a capture nothing can be pinned, and the buffers the capture takes stay its
  own (every replay writes them): CUDA graph trees run each graph eagerly before recording it, which pins them.
- Every copy runs on one side stream per device, so the compute stream never waits for a copy it does not need
  yet. An offload's device tensor is not handed to the allocator with record_stream (whose deferred free a
  capture would turn into memory never reused): the pass gives the next layer's first offload the tensors and
  tokens of this layer's, so Inductor keeps each tensor alive until that offload has made the compute stream
  wait for its copy; the forward's last offload waits for the copies still running.
- A reload copies into a block of the compute stream (once the compute stream is done with it), makes the compute
  stream wait for that copy only, then starts the copies of the tensors it was given to prefetch (the next
  layer's), which run under this layer's backward compute. D2H and H2D copies share the side stream, so a
  buffer is never written before the copy out of it is done.
On the CPU both are plain copies (the pipeline inserts them only for accelerators).
"""

import torch

_side_streams = {}
_free_buffers = {}  # (device, shape, dtype) → pinned host buffers no saved tensor holds (per device: each device's
# side stream orders the copies in and out of its buffers)
_host_of = {}  # token address → the host buffer holding its tensor
_copy_done = {}  # token address → the event after its copy out
_prefetched = {}  # token address → (device tensor, event after its copy in, prefetch batch)
_batch = 0


def offload(x: torch.Tensor, after: list, keep: list, wait: bool) -> torch.Tensor:
    """Start copying x to a host buffer; first make the compute stream wait for the copies of `after` (tokens of
    earlier offloads, whose tensors are `keep`: held until here); with `wait`, for this copy too."""
    del keep  # an input only so that Inductor keeps those tensors alive until this point
    token = torch.zeros(1, dtype=torch.uint8, device=x.device)  # never read; zeros: the same each call
    if x.device.type == "cpu":
        _host_of[token.data_ptr()] = x.clone(memory_format=torch.contiguous_format)
        return token
    compute, side = _streams(x.device)
    for earlier in after:
        compute.wait_event(_copy_done.pop(earlier.data_ptr()))
    host = _take_buffer(x)
    side.wait_stream(compute)  # x is written
    with side:
        host.copy_(x, non_blocking=True)
    done = side.record_event()
    if wait:
        compute.wait_event(done)
    else:
        _copy_done[token.data_ptr()] = done
    _host_of[token.data_ptr()] = host
    return token


def reload(token: torch.Tensor, device: torch.device, prefetch: list) -> torch.Tensor:
    if token.data_ptr() not in _host_of:
        raise RuntimeError(
            "graphopt offload: this saved tensor was already reloaded, and its host buffer reused. With "
            "offload=True each forward takes one backward; for a second (retain_graph=True), compile without "
            "offload")
    if device.type == "cpu":
        return _host_of.pop(token.data_ptr()).clone()
    entry = _prefetched.pop(token.data_ptr(), None)
    result, done = entry[:2] if entry is not None else _copy_in(token, device)
    torch.accelerator.current_stream(device).wait_event(done)
    if prefetch:
        _start_prefetch(prefetch, device)
    _release(token)
    return result


def _take_buffer(x):
    free = _free_buffers.setdefault((x.device, tuple(x.shape), x.dtype), [])
    if free:
        return free.pop()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"graphopt offload under CUDA graphs: no host buffer of shape {tuple(x.shape)} ({x.dtype}) was pinned "
            f"before this capture. CUDA graph trees run each graph once before recording it, which pins them; a "
            f"second graph recorded for the same forward (two forwards before their backwards) finds none free. "
            f"Run one forward at a time before its backward, or compile with options={{'cuda_graphs': False}}")
    return torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)


def _release(token):
    """The token's host buffer back to the free ones, unless a capture is under way: then it belongs to the
    graph being recorded, whose replays write and read it."""
    if not torch.cuda.is_current_stream_capturing():
        host = _host_of.pop(token.data_ptr())
        _free_buffers[(token.device, tuple(host.shape), host.dtype)].append(host)


def _start_prefetch(tokens, device):
    global _batch
    _batch += 1
    # A prefetch still pending from two batches ago was never reloaded (a backward abandoned midway, or a graph
    # whose reload order changed): drop it, so at most two layers' copies are ever held.
    for key in [k for k, entry in _prefetched.items() if entry[2] < _batch - 1]:
        del _prefetched[key]
    for token in tokens:
        result, done = _copy_in(token, device)
        _prefetched[token.data_ptr()] = (result, done, _batch)


def _copy_in(token, device):
    host = _host_of[token.data_ptr()]
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
