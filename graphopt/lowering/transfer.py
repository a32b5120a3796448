"""Saved activations to host memory and back, overlapped with compute: the bodies of graphopt::offload and
graphopt::reload (lowering/ops.py), which passes/offload.py inserts into the partitioned graphs.

Both run the same way eagerly and under CUDA graph capture, so Inductor captures them with the rest of the step:
- No host tensor crosses a graph's boundary. The forward saves a token for each offloaded tensor, a one-byte
  tensor on its device, and the host copy lives here, found by the token's address.
- Host buffers are pinned once and reused: an offload takes the smallest free buffer that holds it, or pins a new
  one of the next power of two bytes; a reload gives it back. Sizes that change every step (a graph compiled for
  every length) so reuse the buffers of longer steps; what is pinned stays under four times what the longest step
  holds (each buffer at most twice its tensor, and the smaller ones a longer step outgrew at most as much again).
  Under a capture nothing can be pinned, and the buffers the capture takes stay its own (every replay writes
  them): CUDA graph trees run each graph eagerly before recording it, which pins them.
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
_free_buffers = {}  # device → pinned host buffers (bytes) no saved tensor holds (per device: each device's side
# stream orders the copies in and out of its buffers)
_host_of = {}  # token address → (the pinned buffer, the tensor: a view of its first bytes)
_copy_done = {}  # token address → the event after its copy out
_prefetched = {}  # token address → (device tensor, event after its copy in, prefetch batch)
_held_for_graphs = []  # pinned buffers that a recorded CUDA graph may still write: never freed nor reused
_batch = 0


def offload(x: torch.Tensor, after: list, keep: list, wait: bool) -> torch.Tensor:
    """Start copying x to a host buffer; first make the compute stream wait for the copies of `after` (tokens of
    earlier offloads, whose tensors are `keep`: held until here); with `wait`, for this copy too."""
    del keep  # an input only so that Inductor keeps those tensors alive until this point
    token = torch.zeros(1, dtype=torch.uint8, device=x.device)  # never read; zeros: the same each call
    if x.device.type == "cpu":
        copy = x.clone(memory_format=torch.contiguous_format)
        _host_of[token.data_ptr()] = (copy, copy)
        return token
    compute, side = _streams(x.device)
    for earlier in after:
        compute.wait_event(_copy_done.pop(earlier.data_ptr()))
    buffer = _take_buffer(x)
    host = buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
    side.wait_stream(compute)  # x is written
    with side:
        host.copy_(x, non_blocking=True)
    done = side.record_event()
    if wait:
        compute.wait_event(done)
    else:
        _copy_done[token.data_ptr()] = done
    _retire(token)
    _host_of[token.data_ptr()] = (buffer, host)
    return token


def reload(token: torch.Tensor, device: torch.device, prefetch: list) -> torch.Tensor:
    if token.data_ptr() not in _host_of:
        raise RuntimeError(
            "graphopt offload: this saved tensor was already reloaded, and its host buffer reused. With "
            "offload=True each forward takes one backward; for a second (retain_graph=True), compile without "
            "offload")
    if device.type == "cpu":
        return _host_of.pop(token.data_ptr())[1].clone()
    entry = _prefetched.pop(token.data_ptr(), None)
    result, done = entry[:2] if entry is not None else _copy_in(token, device)
    torch.accelerator.current_stream(device).wait_event(done)
    if prefetch:
        _start_prefetch(prefetch, device)
    _release(token)
    return result


def _take_buffer(x):
    """The smallest free pinned buffer of x's device that holds x's bytes, taken off the free ones; else a new one."""
    size = x.numel() * x.element_size()
    free = _free_buffers.setdefault(x.device, [])
    fitting = [i for i, buffer in enumerate(free) if buffer.numel() >= size]
    if fitting:
        return free.pop(min(fitting, key=lambda i: free[i].numel()))
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"graphopt offload under CUDA graphs: no host buffer of {size} bytes (shape {tuple(x.shape)}, "
            f"{x.dtype}) was pinned before this capture. CUDA graph trees run each graph once before recording it, "
            f"which pins them; a second graph recorded for the same forward (two forwards before their backwards) "
            f"finds none free. Run one forward at a time before its backward, or compile with "
            f"options={{'cuda_graphs': False}}")
    return torch.empty(1 << max(size - 1, 0).bit_length(), dtype=torch.uint8, device="cpu", pin_memory=True)


def _retire(token):
    """A new token at the address of one still holding a buffer: that tensor was never reloaded (a backward
    abandoned, or the CUDA graphs that saved it are gone). Its buffer is never freed here: freed during a capture,
    torch's host allocator records its event in the captured stream, and the next capture fails as it starts
    (empty_cache cannot query that event: "CUDA error: invalid argument"). Eagerly the buffer goes back to the free
    ones (a live graph's tokens are in its pool, which no eager tensor shares); under a capture it may still be a
    recorded graph's (the pool's addresses are reused within it), so it stays held."""
    stale = _host_of.pop(token.data_ptr(), None)
    if stale is not None:
        held = _held_for_graphs if torch.cuda.is_current_stream_capturing() else _free_buffers[token.device]
        held.append(stale[0])


def _release(token):
    """The token's host buffer back to the free ones, unless a capture is under way: then it belongs to the
    graph being recorded, whose replays write and read it."""
    if not torch.cuda.is_current_stream_capturing():
        buffer, _ = _host_of.pop(token.data_ptr())
        _free_buffers[token.device].append(buffer)


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
    host = _host_of[token.data_ptr()][1]
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
