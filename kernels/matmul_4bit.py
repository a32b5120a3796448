"""Matmuls with a bitsandbytes 4-bit weight dequantized inside the kernel's main loop (W4A16): the dequantized
weight never exists whole. kernels/reference.py's dequantize_4bit defines the weight they must use.

bitsandbytes' layout: the [N, K] weight's elements in row-major order, two a byte, the even element in the high
nibble; element i is code[nibble] · absmax[i // blocksize], code the 16 values of NF4 or FP4. With double
quantization the absmax are themselves 8-bit; the launch functions dequantize them first (N·K / blocksize values,
bitsandbytes' own op), so the kernels read fp32 absmax only. Accumulation in fp32, one rounding to the output.

    forward   y[M, N] = x[M, K] · Wᵀ
    backward  dx[M, K] = dy[M, N] · W

A weight whose rows do not end at a block boundary (K % blocksize ≠ 0: no LLM projection) is not taken
(supported): bitsandbytes' CPU dequantization then reads the blocks otherwise than its quantization wrote them.

Measured against dequantizing into a temporary + cuBLAS in benchmarks/matmul_4bit.py; which one the CUDA lowering
runs is chosen from that measurement (benchmarks/RESULTS.md).
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout
from graphopt.kernels.layout import as_rows
from graphopt.kernels.reference import NESTED_BLOCKSIZE


@triton.jit
def _weight_tile(packed, absmax, code, n, k, K, BLOCKSIZE: tl.constexpr):
    """The dequantized weight at rows n [BN] (each < N) and columns k [BK] (fp32, [BN, BK]); 0 at k ≥ K."""
    inside = (n[:, None] >= 0) & (k[None, :] < K)
    flat = n[:, None].to(tl.int64) * K + k[None, :]
    byte = tl.load(packed + flat // 2, mask=inside, other=0).to(tl.int32)
    nibble = tl.where(flat % 2 == 0, byte >> 4, byte & 15)
    scale = tl.load(absmax + flat // BLOCKSIZE, mask=inside, other=0.0)
    return tl.load(code + nibble) * scale


@triton.jit
def _matmul_4bit_forward_kernel(X, PACKED, ABSMAX, CODE, Y, M, N, K, stride_x, stride_y,
                    BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.minimum(cols, N - 1)  # rows of W past N read row N - 1; their outputs are not stored
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = _weight_tile(PACKED, ABSMAX, CODE, n, k, K, BLOCKSIZE)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32)
    tl.store(Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _matmul_4bit_backward_kernel(DY, PACKED, ABSMAX, CODE, DX, M, N, K, stride_dy, stride_dx,
                     BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        dy = tl.load(DY + rows[:, None].to(tl.int64) * stride_dy + cols[None, :],
                     mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
        w = _weight_tile(PACKED, ABSMAX, CODE, tl.minimum(cols, N - 1), k, K, BLOCKSIZE)
        w = tl.where(cols[:, None] < N, w, 0.0)  # rows of W past N add nothing
        acc += tl.dot(dy, w.to(dy.dtype), out_dtype=tl.float32)
    tl.store(DX + rows[:, None].to(tl.int64) * stride_dx + k[None, :], acc.to(DX.dtype.element_ty),
             mask=(rows[:, None] < M) & (k[None, :] < K))


def supported(shape, blocksize) -> bool:
    return shape[1] % blocksize == 0


def block_absmax(absmax, absmax_8bit, absmax_code, absmax_offset):
    """Each block's fp32 absmax: as given, or dequantized from double quantization by bitsandbytes' op."""
    if absmax_8bit is None:
        return absmax.float()
    return torch.ops.bitsandbytes.dequantize_blockwise(absmax_8bit, absmax, absmax_code, NESTED_BLOCKSIZE,
                                                       torch.float32) + absmax_offset


def _code(quant_type, device):
    """The 16 values of the quant type, as bitsandbytes defines them."""
    from bitsandbytes import functional

    return functional.get_4bit_type(quant_type, device=device).float()


def _blocks(t: torch.Tensor):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): tiles of 64 (16 under the interpreter, which runs them as numpy)."""
    if layout.platform(t) == "cpu":
        return 16, 16, 16, 1
    return 64, 64, 64, layout.num_warps(t, 4)


def forward(x, packed, shape, absmax, blocksize, quant_type, absmax_8bit, absmax_code, absmax_offset, out_dtype):
    """x [..., K] · Wᵀ → [..., N] in out_dtype, W the [N, K] 4-bit weight."""
    n_out, k_in = shape
    rows = as_rows(x, k_in)
    y = torch.empty(rows.shape[0], n_out, dtype=out_dtype, device=x.device)
    scales = block_absmax(absmax, absmax_8bit, absmax_code, absmax_offset)
    block_m, block_n, block_k, warps = _blocks(x)
    grid = (layout.cdiv(rows.shape[0], block_m), layout.cdiv(n_out, block_n))
    _matmul_4bit_forward_kernel[grid](rows, packed, scales, _code(quant_type, x.device), y, rows.shape[0], n_out,
                                      k_in, rows.stride(0), y.stride(0), BLOCKSIZE=blocksize, BLOCK_M=block_m,
                                      BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y.view(*x.shape[:-1], n_out)


def backward(grad, packed, shape, absmax, blocksize, quant_type, absmax_8bit, absmax_code, absmax_offset, out_dtype):
    """grad [..., N] · W → [..., K] in out_dtype."""
    n_out, k_in = shape
    rows = as_rows(grad, n_out)
    dx = torch.empty(rows.shape[0], k_in, dtype=out_dtype, device=grad.device)
    scales = block_absmax(absmax, absmax_8bit, absmax_code, absmax_offset)
    block_m, block_n, block_k, warps = _blocks(grad)
    grid = (layout.cdiv(rows.shape[0], block_m), layout.cdiv(k_in, block_k))
    _matmul_4bit_backward_kernel[grid](rows, packed, scales, _code(quant_type, grad.device), dx, rows.shape[0],
                                       n_out, k_in, rows.stride(0), dx.stride(0), BLOCKSIZE=blocksize,
                                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return dx.view(*grad.shape[:-1], k_in)
