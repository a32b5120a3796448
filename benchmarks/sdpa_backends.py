"""SDPA forward + backward at the Llama-3.2-1B shape on the GPU, per backend, with GQA (enable_gqa) or with k/v
expanded; then the kernels the default choice runs. CUDA only:  python benchmarks/sdpa_backends.py
"""
import torch, time
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
torch.manual_seed(0)
B, H, KV, T, D = 4, 32, 8, 2048, 64
q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
def run(expand, backends):
    def step():
        kk, vv = (k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)) if expand else (k, v)
        with sdpa_kernel(backends):
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
        o.backward(g)
    for _ in range(3): step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): step()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / 10 * 1000
ALL = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
for name, expand, backends in [("default gqa", False, ALL), ("cudnn gqa", False, [SDPBackend.CUDNN_ATTENTION]),
                               ("flash gqa", False, [SDPBackend.FLASH_ATTENTION]),
                               ("efficient gqa", False, [SDPBackend.EFFICIENT_ATTENTION]),
                               ("default expanded", True, ALL), ("flash expanded", True, [SDPBackend.FLASH_ATTENTION]),
                               ("cudnn expanded", True, [SDPBackend.CUDNN_ATTENTION])]:
    try:
        ms = run(expand, backends)
        print(f"{name:18} {ms:7.2f} ms fwd+bwd per layer (x16 = {16 * ms:6.1f} ms/step)", flush=True)
    except Exception as e:
        print(f"{name:18} unavailable: {str(e)[:120]}")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as p:
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(g)
    torch.cuda.synchronize()
print("default picks:", sorted({e.key[:70] for e in p.key_averages() if e.device_type.name == "CUDA"}))
