"""bitsandbytes' 4-bit weights (NF4 or FP4; absmax plain or double-quantized) dequantized in one Triton launch;
kernels/reference.py (dequantize_4bit, bitsandbytes' own ops) defines what it must compute.

The format, as bitsandbytes packs it: element 2i of the flattened weight is the high nibble of byte i, element
2i + 1 the low one (the last low nibble is padding when the count is odd); a nibble indexes the quant type's 16
values; each block of `blocksize` elements has one absmax; the element is value × absmax in fp32, rounded once to
the output dtype. With double quantization a block's absmax is itself a byte: code[byte] × nested[block // 256]
+ offset (bitsandbytes' blockwise 8-bit dequantization, blocks of 256, then the offset).

bitsandbytes takes two launches for a double-quantized weight (the absmax, then the weight) and a round trip of
the absmax through memory; this takes one. The 16 values are read from bitsandbytes itself, on the device the
kernel runs on (its CPU and CUDA tables differ in the last digits of FP4's smallest value), so the kernel
reproduces the library's dequantization there, not a reading of it.
"""

import torch
import triton
import triton.language as tl

from graphopt.kernels import layout
from graphopt.kernels.reference import NESTED_BLOCKSIZE


@triton.jit
def _dequantize_4bit_kernel(
    PACKED, VALUES, ABSMAX, ABSMAX_8BIT, ABSMAX_CODE, ABSMAX_OFFSET, OUT, n_elements,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    # BLOCK bytes a program: 2·BLOCK elements, written as one contiguous run (the two nibbles interleaved)
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = 2 * byte < n_elements
    codes = tl.load(PACKED + byte, mask=in_range, other=0).to(tl.int32)
    # a constant block size makes this division a shift (bitsandbytes' are powers of two); a runtime one costs
    # more instructions per byte than the rest of the kernel. Even: both nibbles of a byte share a block
    block = (2 * byte) // BLOCKSIZE
    if NESTED:
        absmax_byte = tl.load(ABSMAX_8BIT + block, mask=in_range, other=0).to(tl.int32)
        scale = tl.load(ABSMAX_CODE + absmax_byte) * tl.load(ABSMAX + block // NESTED_BLOCK, mask=in_range,
                                                             other=0.0) + tl.load(ABSMAX_OFFSET)
    else:
        scale = tl.load(ABSMAX + block, mask=in_range, other=0.0)
    high = tl.load(VALUES + (codes >> 4)) * scale
    low = tl.load(VALUES + (codes & 15)) * scale
    element = 2 * tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(OUT + element, tl.interleave(high, low).to(OUT.dtype.element_ty), mask=element < n_elements)


# (quant type, device) → the 16 values. Made before a graph that reads them compiles (lowering/cuda.py: prepare):
# made at its first call, inside a CUDA graph tree's warm-up, a table would sit in the tree's memory pool, where
# every live tensor must be a graph output
_values = {}


def quant_values(quant_type, device):
    """The 16 values of quant_type's codes, each dequantized by bitsandbytes on `device` with an absmax of 1."""
    key = (quant_type, torch.device(device))
    if key not in _values:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

        codes = torch.arange(16, dtype=torch.uint8)
        packed = (codes[0::2] << 4 | codes[1::2]).to(device)
        ones = torch.ones(1, dtype=torch.float32, device=device)
        _values[key] = torch.ops.bitsandbytes.dequantize_4bit(packed, ones, 64, quant_type, [16],
                                                              torch.float32).reshape(16)
    return _values[key]


def dequantize_4bit(packed, shape, absmax, blocksize, quant_type, absmax_8bit, absmax_code, absmax_offset, dtype):
    """The [out, in] weight in dtype, as kernels/reference.py's dequantize_4bit gives it, from the op's arguments
    (lowering/ops.py: check_lora_linear_4bit holds: uint8 codes, an even block size)."""
    n_elements = shape[0] * shape[1]
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    if n_elements == 0:
        return out
    nested = absmax_8bit is not None
    # 512 bytes a program in 4 warps: the fastest of 512–4096 bytes in 2–8 warps on the H200
    # (benchmarks/RESULTS.md); the interpreter pays per program, not per element
    block = 32768 if layout.platform(packed) == "cpu" else 512
    _dequantize_4bit_kernel[(layout.cdiv(layout.cdiv(n_elements, 2), block),)](
        packed.reshape(-1), quant_values(quant_type, packed.device), absmax.reshape(-1),
        absmax_8bit.reshape(-1) if nested else absmax, absmax_code if nested else absmax,
        absmax_offset.reshape(-1) if nested else absmax, out, n_elements, BLOCKSIZE=blocksize,
        NESTED=nested, NESTED_BLOCK=NESTED_BLOCKSIZE, BLOCK=block, num_warps=layout.num_warps(packed, 4),
        enable_fp_fusion=False,  # a nested absmax's multiply and add rounded apart, as bitsandbytes rounds them
    )
    return out
