"""kernels/matmul_4bit.py: matmuls with a bitsandbytes 4-bit weight dequantized in the kernel's main loop, against
fp64 matmuls with the weight bitsandbytes itself dequantizes (NF4 and FP4, double quantization or not, block sizes
64 and 128, sizes that end inside a tile; rows of whole blocks, as every LLM projection's: matmul_4bit.supported).
On the CPU through the Triton interpreter (fp32; it computes bf16 wrong), on CUDA compiled, bf16 too."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from graphopt.kernels import matmul_4bit
from graphs import relative_error

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes import functional as bnb_functional  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def quantized(n, k, quant_type, blocksize, nested):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type,
                                                 compress_statistics=nested)
    absmax = (state.state2.absmax, state.absmax, state.state2.code, state.offset) if nested else (
        state.absmax, None, None, None)
    return (packed, [n, k], absmax[0], blocksize, quant_type, *absmax[1:]), bnb_functional.dequantize_4bit(
        packed, state).double().cpu()


@settings(max_examples=12, deadline=None)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), blocksize=st.sampled_from([64, 128]), nested=st.booleans(),
       n=st.integers(2, 40), blocks=st.integers(1, 3), m=st.integers(1, 20),
       dtype=st.sampled_from(DTYPES))
def test_forward_and_backward_match_fp64(quant_type, blocksize, nested, n, blocks, m, dtype):
    k = blocks * blocksize
    assert matmul_4bit.supported([n, k], blocksize)
    base, weight = quantized(n, k, quant_type, blocksize, nested)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    grad = torch.randn(m, n, generator=g).to(DEVICE, dtype)
    y = matmul_4bit.forward(x, *base, dtype)
    dx = matmul_4bit.backward(grad, *base, dtype)
    assert y.shape == (m, n) and dx.shape == (m, k) and y.dtype == dx.dtype == dtype
    assert relative_error(y.cpu(), x.double().cpu() @ weight.t()) <= TOLERANCE[dtype]
    assert relative_error(dx.cpu(), grad.double().cpu() @ weight) <= TOLERANCE[dtype]


def test_leading_dimensions_are_kept():
    base, weight = quantized(24, 64, "nf4", 64, True)
    x = torch.randn(2, 3, 64).to(DEVICE)
    assert relative_error(matmul_4bit.forward(x, *base, torch.float32).cpu(),
                          x.double().cpu() @ weight.t()) <= 1e-5
