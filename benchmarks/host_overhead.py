"""Host time of graphopt's GPU launch functions: what a training step pays on the CPU per op call, with every
Triton launch stubbed out and the tensors tiny, so that nothing but graphopt's Python is timed. A step is bound by
this on hosts whose CPU launches kernels slower than the GPU runs them (benchmarks/RESULTS.md).

    python benchmarks/host_overhead.py            (on any machine: no GPU needed)
    python benchmarks/host_overhead.py --gpu      (on a GPU: each op called three ways, launches real)

Each launch function takes the NVIDIA path (launch settings, precision choices) on fp32 CPU tensors. The base
matmuls (cuBLAS on the GPU) run on the CPU here: their time is measured alone and subtracted.

--gpu: the ops as a compiled graph calls them, on tensors so small (64 tokens) that the GPU waits for the host,
each called as the custom op (torch.ops.graphopt: custom_op's autograd layer, redispatch and aliasing check),
as the direct op compiled graphs call (torch.ops.graphopt_cuda, lowering/direct.py), and as the bare kernel
function of lowering/cuda.py; wall time per call, under no_grad as in a compiled graph.
"""

import sys
import time

import torch
from triton.runtime.jit import JITFunction

from graphopt.kernels import cross_entropy, gated_activation, layout, lora, rmsnorm, rope


def per_call_us(fn, calls=3000, synchronize=lambda: None):
    """Wall µs per call of fn; synchronize waits for what the calls queued (the GPU's work), before and after."""
    for _ in range(200):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def gpu():
    from graphopt.lowering import cuda

    tokens, hidden, out, rank = 64, 2048, 2048, 16
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out, hidden, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rank, hidden, device="cuda")
    b = torch.randn(out, rank, device="cuda")
    g = torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16)
    xa = x.float() @ a.t()
    q = torch.randn(1, 32, tokens, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, tokens, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(1, tokens, 64, device="cuda"), torch.randn(1, tokens, 64, device="cuda")
    calls = {
        "lora_down": (x, a),
        "lora_linear": (x, w, None, a, b, xa, 2.0, torch.bfloat16),
        "lora_linear_backward": (g, x, xa, w, a, b, 2.0),
        "rope": (q, k, cos, sin),
    }

    def timed(fn, args):
        return per_call_us(lambda: fn(*args), 2000, torch.cuda.synchronize)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {tokens} tokens, wall µs per call\n")
    print("| op | custom op (graphopt::) | direct op (graphopt_cuda::) | kernel function |")
    print("| --- | ---: | ---: | ---: |")
    with torch.no_grad():
        for name, args in calls.items():
            op = getattr(torch.ops.graphopt, name).default
            direct = getattr(torch.ops.graphopt_cuda, name).default
            print(f"| {name} | {timed(op, args):.1f} | {timed(direct, args):.1f} | "
                  f"{timed(cuda.KERNELS[op], args):.1f} |")


def main():
    if "--gpu" in sys.argv:
        return gpu()
    JITFunction.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)  # every launch: a no-op
    layout.platform = lambda t: "cuda"
    layout.multiprocessors = lambda device: 132  # the H200's
    dtype = torch.float32  # the base matmuls are timed too: fp32 keeps them short on the CPU
    x, w = torch.randn(8, 32, dtype=dtype), torch.randn(48, 32, dtype=dtype)
    a, b, g = torch.randn(16, 32), torch.randn(48, 16), torch.randn(8, 48, dtype=dtype)
    xa = x @ a.t()
    matmul = per_call_us(lambda: torch.nn.functional.linear(x, w))
    norm_w = torch.randn(32, dtype=dtype)
    q, k = torch.randn(1, 4, 8, 16, dtype=dtype), torch.randn(1, 2, 8, 16, dtype=dtype)
    cos, sin = torch.randn(1, 8, 16, dtype=dtype), torch.randn(1, 8, 16, dtype=dtype)
    head, target = torch.randn(8, 32, dtype=dtype), torch.randint(0, 48, (8,))
    rows = [
        ("lora_down", lambda: lora.lora_down_forward(x, a), 0),
        ("lora_linear forward", lambda: lora.lora_linear_forward(x, w, None, b, xa, 2.0, dtype), 1),
        ("lora_linear backward", lambda: lora.lora_linear_backward(g, x, xa, w, a, b, 2.0), 1),
        ("rms_norm forward", lambda: rmsnorm.rms_norm_forward(x, norm_w, 1e-6, 0.0, dtype), 0),
        ("rms_norm backward", lambda: rmsnorm.rms_norm_backward(x, x, norm_w, 1e-6, 0.0, False), 0),
        ("rope forward", lambda: rope.rope_forward(q, k, cos, sin), 0),
        ("gated_activation forward", lambda: gated_activation.gated_activation_forward(x, x, "silu"), 0),
        ("linear_cross_entropy (1 chunk)",
         lambda: cross_entropy.linear_cross_entropy(head, w, None, target, -100, "mean", 0.0, 8, True, False), 2),
    ]
    print(f"torch {torch.__version__}; a tiny CPU matmul takes {matmul:.1f} µs (subtracted per matmul below)\n")
    print("| launch function | host µs per call |\n| --- | ---: |")
    for name, fn, matmuls in rows:
        print(f"| {name} | {per_call_us(fn) - matmuls * matmul:.1f} |")


if __name__ == "__main__":
    main()
