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
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    # ROWS absmax blocks a program, as a [ROWS, BLOCKSIZE / 2] tile of bytes: each block's scale is decoded once
    # and broadcast over its bytes, not gathered again for every byte. Each row's 2 · BLOCKSIZE / 2 elements are
    # written as one contiguous run (the two nibbles of a byte interleaved; even block sizes keep them in one block)
    HALF: tl.constexpr = BLOCKSIZE // 2
    block = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    block_in_range = block * BLOCKSIZE < n_elements
    if NESTED:
        absmax_byte = tl.load(ABSMAX_8BIT + block, mask=block_in_range, other=0).to(tl.int32)
        scale = tl.load(ABSMAX_CODE + absmax_byte) * tl.load(ABSMAX + block // NESTED_BLOCK, mask=block_in_range,
                                                             other=0.0) + tl.load(ABSMAX_OFFSET)
    else:
        scale = tl.load(ABSMAX + block, mask=block_in_range, other=0.0)
    byte = block[:, None] * HALF + tl.arange(0, HALF)[None, :]
    codes = tl.load(PACKED + byte, mask=2 * byte < n_elements, other=0).to(tl.int32)
    high = tl.load(VALUES + (codes >> 4)) * scale[:, None]
    low = tl.load(VALUES + (codes & 15)) * scale[:, None]
    element = block[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(OUT + element, tl.interleave(high, low).to(OUT.dtype.element_ty), mask=element < n_elements)


# Bytes a program reads (whole absmax blocks, at least one) and its warps, per platform. CUDA: 1,024 bytes in 4 warps,
# within 1% (1B's weights) and 4% (8B's) of the best setting of `benchmarks/dequantize_4bit.py --sweep` on the H100;
# no setting is best at both (benchmarks/RESULTS.md, QLoRA, "The two changes: outcome"). AMD takes CUDA's bytes, its
# warps through layout.num_warps (the same threads a program). The interpreter pays per program, not per element.
CONFIGS = {"cuda": dict(BYTES=1024, num_warps=4), "cpu": dict(BYTES=32768, num_warps=4)}


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
    config = CONFIGS["cpu" if layout.platform(packed) == "cpu" else "cuda"]
    rows = max(1, config["BYTES"] // (blocksize // 2))
    _dequantize_4bit_kernel[(layout.cdiv(layout.cdiv(n_elements, blocksize), rows),)](
        packed.reshape(-1), quant_values(quant_type, packed.device), absmax.reshape(-1),
        absmax_8bit.reshape(-1) if nested else absmax, absmax_code if nested else absmax,
        absmax_offset.reshape(-1) if nested else absmax, out, n_elements, BLOCKSIZE=blocksize,
        NESTED=nested, NESTED_BLOCK=NESTED_BLOCKSIZE, ROWS=rows,
        num_warps=layout.num_warps(packed, config["num_warps"]),
        enable_fp_fusion=False,  # a nested absmax's multiply and add rounded apart, as bitsandbytes rounds them
    )
    return out
