"""Launch helpers shared by the kernels' launch functions: which platform's settings a tensor takes, the GPU's
size, and tensor layouts.

AMD's settings are derived by rule from NVIDIA's, which were measured on the H200; none was measured on AMD
hardware (there was none to tune on). Every kernel is compiled for gfx942 and gfx1100 in CI
(tests/test_aot.py)."""

import contextlib
import functools
import weakref

import torch

from graphopt import devices


def platform(t: torch.Tensor) -> str:
    """Whose launch settings a kernel takes for t: "cuda" (NVIDIA), "cdna" or "rdna" (AMD under ROCm, which shows
    its GPUs as cuda devices), or "cpu" (Triton's interpreter, which wants few, large programs)."""
    if t.device.type != "cuda":
        return t.device.type
    return _amd_family(t.device) if torch.version.hip else "cuda"


def amd_family(arch: str) -> str:
    """An AMD architecture's family, by its gfx number: "cdna" for gfx9 (gfx950, gfx942 MI300, gfx90a MI250, gfx908
    MI100), whose wavefronts are 64 wide, "rdna" for gfx10, gfx11 and gfx12, 32 wide. Triton sets the wave size
    by the same line (64 below gfx10), so an arch not listed here (a new gfx9 → "cdna", anything else → "rdna")
    still gets the settings for the wave size it is compiled with."""
    return "cdna" if arch.startswith("gfx9") else "rdna"


@functools.lru_cache(maxsize=None)
def _amd_family(device: torch.device) -> str:  # read once per device: platform() runs at every launch
    return amd_family(devices.gfx_arch(torch.cuda.get_device_properties(device)))


def num_warps(t: torch.Tensor, nvidia_warps: int) -> int:
    """num_warps for a kernel launched on t, from the num_warps it was tuned with on NVIDIA (warps of 32): the
    same threads per program on every GPU, so that each thread does the work and holds the registers it was tuned
    for. CDNA's wavefronts are 64 wide: half as many, at least one. RDNA's are 32 wide, as NVIDIA's."""
    return max(1, nvidia_warps // 2) if platform(t) == "cdna" else nvidia_warps


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The GPU's SMs (NVIDIA) or compute units (AMD): launches that split work to fill the GPU size it by this."""
    return torch.cuda.get_device_properties(device).multi_processor_count


_traced = False  # launches_traced() is active


@contextlib.contextmanager
def launches_traced():
    """While active, launcher() wraps each Triton kernel for a trace (torch.library.wrap_triton): a launch function
    called on fake tensors records its launches into a graph, which Inductor then launches from its generated code
    (lowering/traced.py). Outside it, kernels launch as plain Triton calls: wrap_triton's wrapper costs host time
    at every launch."""
    global _traced
    before, _traced = _traced, True
    try:
        yield
    finally:
        _traced = before


def tracing() -> bool:
    """Whether launches_traced() is active: the launch function is being traced into a graph, whose sizes may be
    symbols that no launch decision may branch on (kernels/lora.py _column_splits)."""
    return _traced


def launcher(kernel):
    """kernel, to be indexed by its grid and called; wrapped for the trace under launches_traced()."""
    return torch.library.wrap_triton(kernel) if _traced else kernel


def capturing() -> bool:
    """Whether the current GPU stream is being captured into a CUDA graph, whose replays cost the host nothing a
    launch. False where CUDA was never initialized: no capture can run there, and a CPU-only torch (the AOT tests
    run the launch functions for GPU targets on the CPU) cannot be asked."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# Unspecialized sizes: a kernel's integer arguments that follow the batch's token count (rows, sequence length) are
# named in its do_not_specialize. Triton compiles a kernel again for every new combination of "divisible by 16"
# and "equal to 1" among its integer arguments; with batches of varying length (a graph of dynamic shapes) the
# combinations turn up one by one, each a compile inside a training step. Unspecialized, one compile serves every
# length; what it gives up is a divisibility hint on a row count, which only masks and loop bounds read.

# Host-side integer helpers for launch functions. triton.cdiv and triton.next_power_of_2 are constexpr functions
# since Triton 3.5: about 4 µs a call from Python, ~14 calls in one LoRA backward, where the step is bound by the
# host's launch speed (benchmarks/RESULTS.md). Inside @triton.jit code, use tl.cdiv.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ≥ n (1 for n ≤ 1)."""
    return 1 << max(n - 1, 0).bit_length()


def known_zero(size) -> bool:
    """Whether a launch's size is 0, where that is known without a guard: a symbolic size (a dynamic graph's,
    traced) is at least 2."""
    return isinstance(size, int) and size == 0


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t as a [rows, n_cols] matrix with unit column stride: a view when possible, else a contiguous copy."""
    rows = t.reshape(-1, n_cols)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def once_per_tensor(derive):
    """derive(t), computed once for a tensor that every layer of a graph reads (packed batches' position_ids) and
    reused while that same tensor, unchanged, comes back: the other layers of the forward, the backward, a
    recomputed forward. Only the last tensor is kept (a new batch replaces it). A tensor is the same one when it is
    the same object with the same version counter, which every in-place write through torch bumps; a Triton kernel
    writing into a buffer does not, so t must be a graph input (which compiled code never writes) or a buffer the
    graph computes once and every layer reads (the padded attention's keep, passes/attention.py _on_device):
    compiled code hands a buffer on to another value only after its last reader. Inference tensors have no version
    counter and are derived at every call.

    While a CUDA graph is being captured, derive runs at every call and nothing is kept: each capture then holds
    its own derivation, replayed with it. A result kept across captures would tie one graph's replay to buffers
    that another capture (or an eager run) wrote, where CUDA graph trees neither see the dependency nor keep the
    buffers, and a graph's output comes back as the same tensor at every replay, its contents new and its version
    the same: the reuse would read another batch's result.

    Where a launch function is traced (launches_traced), derive runs at every call too: its operations join each
    call's trace, and the graph computes them once (lowering/traced.py share_repeats)."""
    last = [None, -1, None]  # a weak reference to the tensor, its version, derive's result

    @functools.wraps(derive)
    def once(t):
        if t.is_inference() or capturing() or tracing():
            return derive(t)
        ref, version, result = last
        if ref is not None and ref() is t and version == t._version:
            return result
        result = derive(t)
        last[:] = weakref.ref(t), t._version, result
        return result

    return once
