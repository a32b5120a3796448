"""LoRA Linear on the GPU with fp32 adapters on a bf16/fp16/fp32 base; kernels/reference.py defines it.

The frozen base matmuls (x·Wᵀ forward, dY·W backward) stay cuBLAS, accumulating (β = 1) onto the low-rank term
the Triton kernels write first: each output is written once by a memory-bound kernel and read once more in the
epilogue of a compute-bound matmul, where a separate add would read and write it again. Everything PEFT does
around the base matmuls in the adapter dtype — the upcast of x, x·Aᵀ, ·Bᵀ, the scaling, the add, the cast back,
and the same in the backward — runs in Triton kernels that read each large tensor once and keep fp32 values in
registers, never in memory: no fp32 copy of x or of the output exists, saved or transient. The forward's x·Aᵀ
([tokens, rank] fp32, as PEFT's autograd keeps it; graphopt::lora_down's output) is saved for the backward, which
would otherwise read x once more to recompute it. The forward is two launches and a matmul (x·Aᵀ, lora_down; ·Bᵀ,
scale and the bias, then x·Wᵀ added, lora_linear), the
backward four and a matmul, as the H200's step is partly bound by how fast the CPU launches kernels: dY·B in one,
dA's and dB's partial sums over splits of the rows in one, their sum in one, and dX's low-rank term in one, onto
which dY·W is added. Where too few row blocks would leave multiprocessors idle, the projections split the columns
too, and one more launch sums the partial products (CONFIGS' FILL; TRACED_COLUMNS where the row count is a
symbol). The rank-r products keep fp32's accuracy on tensor cores: with a bf16 x, bf16 dots on the fp32 operand
split in two bf16 parts (below, _split); otherwise "tf32x3", three TF32 products (PEFT's fp32 matmuls run without
TF32). Plain fp32 "ieee" dots run on the CUDA cores, which made these memory-bound kernels compute-bound (2.4x slower
in the 1B step on the H200, benchmarks/RESULTS.md).
"""

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from graphopt.kernels import layout
from graphopt.kernels.layout import as_rows


# On NVIDIA with a bf16 x (or dY), the rank-r products run as bf16 tensor-core dots with fp32 accumulation, the fp32
# operand split in two bf16 parts (hi = bf16(v), lo = bf16(v - hi), 16 significant bits together): x is exact in
# bf16, so x·hi + x·lo is the fp32 product to ~2^-17 relative, two dots at bf16's rate and no per-element work on
# the large operand (tf32x3 splits both operands and runs three dots at half that rate). Where both operands are
# fp32 (·Bᵀ in _add_low_rank_kernel), three dots hi·hi + hi·lo + lo·hi, rounded into a bf16 output anyway.
# Not for the CPU interpreter, which computes bf16 dots wrong (DESIGN.md): the launch functions choose it on CUDA.
@triton.jit
def _split(v):
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_exact_by_split(x_bf16, w):
    hi, lo = _split(w)
    return tl.dot(x_bf16, hi) + tl.dot(x_bf16, lo)


@triton.jit
def _split_dot_exact(g, x_bf16):
    hi, lo = _split(g)
    return tl.dot(hi, x_bf16) + tl.dot(lo, x_bf16)


@triton.jit
def _dot_bf16x3(a, b):
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    return tl.dot(a_hi, b_hi) + tl.dot(a_hi, b_lo) + tl.dot(a_lo, b_hi)


@triton.jit(do_not_specialize=["n_rows", "stride_split"])  # token-count sizes: kernels/layout.py
def _project_kernel(X, W, Y, n_rows, n_cols, cols_per_split, rank, stride_x, stride_wr, stride_wk, stride_split,
                    scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                    PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr):
    # Y[split, m, r] = scale · Σ_k X[m, k] · W[r, k] over the split's columns, for the rows of block program_id(0)
    # and the split program_id(2) (one split: Y[0] is the product); Y[split] is [n_rows, rank] fp32, contiguous
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2).to(tl.int64)
    first = split * cols_per_split
    end = tl.minimum(first + cols_per_split, n_cols)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for start in range(first, end, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :],
                    mask=(rows < n_rows)[:, None] & (ks < end)[None, :], other=0.0)
        w = tl.load(W + ranks[None, :] * stride_wr + ks[:, None] * stride_wk,
                    mask=(ranks < rank)[None, :] & (ks < end)[:, None], other=0.0).to(tl.float32)
        if SPLIT_BF16:
            acc += _dot_exact_by_split(x, w)
        else:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
    tl.store(Y + split * stride_split + rows[:, None] * rank + ranks[None, :], acc * scale,
             mask=(rows < n_rows)[:, None] & (ranks < rank)[None, :])


@triton.jit
def _reduce_split(LOW, X, first, end, n_cols, rank, stride_x, cols,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                  SPLIT_BF16: tl.constexpr):
    # [BLOCK_R, BLOCK_N] fp32 = Σ_{first ≤ m < end} LOW[m, r] · X[m, cols]; LOW is [rows, rank] fp32 contiguous
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for start in range(first, end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        low = tl.load(LOW + rows[None, :] * rank + ranks[:, None],
                      mask=(rows < end)[None, :] & (ranks < rank)[:, None], other=0.0)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :],
                    mask=(rows < end)[:, None] & (cols < n_cols)[None, :], other=0.0)
        if SPLIT_BF16:
            acc += _split_dot_exact(low, x)
        else:
            acc += tl.dot(low, x.to(tl.float32), input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["n_rows", "rows_per_split"])  # token-count sizes: kernels/layout.py
def _reduce_rows_pair_kernel(G, XA, GRAD_XA, X, P, n_rows, n_out, n_in, rank, rows_per_split, stride_g, stride_x,
                             out_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                             PRECISION: tl.constexpr, SPLIT_BF16_X: tl.constexpr, SPLIT_BF16_G: tl.constexpr):
    # Both weight gradients' sums over one split of the rows, into P[split] = (dB [n_out, rank], dA [rank, n_in])
    # flattened: column blocks below out_blocks compute dB = Gᵀ·XA (stored transposed), the others dA = GRAD_XAᵀ·X
    block = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)
    first = split * rows_per_split
    end = tl.minimum(first + rows_per_split, n_rows)
    ranks = tl.arange(0, BLOCK_R)
    partial = P + split * (n_out + n_in) * rank
    if block < out_blocks:
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _reduce_split(XA, G, first, end, n_out, rank, stride_g, cols,
                            BLOCK_M, BLOCK_N, BLOCK_R, PRECISION, SPLIT_BF16_G)
        tl.store(partial + cols[None, :] * rank + ranks[:, None], acc,
                 mask=(ranks < rank)[:, None] & (cols < n_out)[None, :])
    else:
        cols = (block - out_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _reduce_split(GRAD_XA, X, first, end, n_in, rank, stride_x, cols,
                            BLOCK_M, BLOCK_N, BLOCK_R, PRECISION, SPLIT_BF16_X)
        tl.store(partial + n_out * rank + ranks[:, None] * n_in + cols[None, :], acc,
                 mask=(ranks < rank)[:, None] & (cols < n_in)[None, :])


@triton.jit(do_not_specialize=["splits", "first_size", "size"])  # token-count sizes: kernels/layout.py
def _sum_splits_kernel(P, FIRST, SECOND, splits, first_size, size, scale_first, BLOCK: tl.constexpr):
    # FIRST, SECOND = scale_first · Σ_split P[split], Σ_split P[split], P[split] being FIRST's first_size elements
    # then SECOND's (dB's then dA's from _reduce_rows_pair_kernel; the projections' partial sums over column
    # splits), in a fixed order: deterministic
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(0, splits):
        acc += tl.load(P + offsets, mask=offsets < size, other=0.0)
        P += size  # the next split's partial sums
    tl.store(FIRST + offsets, acc * scale_first, mask=offsets < first_size)
    tl.store(SECOND + (offsets - first_size), acc, mask=(offsets >= first_size) & (offsets < size))


@triton.jit(do_not_specialize=["n_rows"])  # token-count sizes: kernels/layout.py
def _add_low_rank_kernel(BASE, XA, W, BIAS, OUT, n_rows, n_cols, rank, stride_base, stride_wn, stride_wr, scale,
                         ADD_BASE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                         SPLIT_BF16: tl.constexpr):
    # OUT[m, n] = scale · Σ_r XA[m, r] · W[n, r], plus BIAS[n] (HAS_BIAS) and BASE[m, n] (ADD_BASE), rounded once
    # to OUT's dtype; OUT is [n_rows, n_cols] contiguous
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    xa = tl.load(XA + rows[:, None] * rank + ranks[None, :],
                 mask=(rows < n_rows)[:, None] & (ranks < rank)[None, :], other=0.0)
    w = tl.load(W + cols[None, :] * stride_wn + ranks[:, None] * stride_wr,
                mask=(cols < n_cols)[None, :] & (ranks < rank)[:, None], other=0.0).to(tl.float32)
    if SPLIT_BF16:
        value = _dot_bf16x3(xa, w) * scale
    else:
        value = tl.dot(xa, w, input_precision=PRECISION) * scale
    if HAS_BIAS:
        value += tl.load(BIAS + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    if ADD_BASE:
        value += tl.load(BASE + rows[:, None] * stride_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * n_cols + cols[None, :], value.to(OUT.dtype.element_ty), mask=mask)


# The fp32 dots' precision per platform: fp32's accuracy from tensor-core products. NVIDIA: three TF32 products;
# AMD (Triton has no tf32x3 there, tests/test_aot.py): six bf16 products; the CPU interpreter multiplies in fp32.
PRECISION = {"cuda": "tf32x3", "cdna": "bf16x6", "rdna": "bf16x6", "cpu": "ieee"}

# Launch configurations per platform (kernels/layout.py). CUDA: benchmarks/lora_configs.py on the H200 at the
# Llama-3.2-1B and Llama-3-8B shapes (benchmarks/RESULTS.md, 2026-12-01: CUDA graphs by default): project and
# reduce_rows the configs in the top two at both shapes (project: BLOCK_K 128 over 64, −10% at 8B, −20% at 1B;
# reduce_rows: BLOCK_M 32, −25% at 1B, −47% at 8B); add_low_rank and sum_splits within the sweep's noise of the
# best. AMD, CDNA (MI300 gfx942, MI250 gfx90a) and RDNA (gfx1100): CUDA's blocks under two rules, not measured
# (there is no AMD hardware to tune on); compiled for gfx942 and gfx1100 in CI (tests/test_aot.py). 1: the threads
# per program CUDA's were tuned with (layout.num_warps): half the num_warps on CDNA's 64-wide wavefronts, the same
# on RDNA's 32-wide ones. 2: two pipeline stages where a loop feeds tl.dot (project over K, reduce_rows over rows),
# the depth Triton's AMD stream pipeliner is built for; add_low_rank has no loop and sum_splits no dot, so they keep
# Triton's default.
# The projections' FILL (programs wanted a multiprocessor, made up by splitting the columns: _column_splits) is 2,
# in the sweep's top four at both shapes in two runs on the H200 (benchmarks/RESULTS.md, QLoRA, "The projections
# over split columns: outcome"): the projections −21% at 8B (4,096 rows: 64 row blocks for 132 multiprocessors),
# within the sweep's noise at 1B (8,192 rows); the lean QLoRA 8B step −7 ms. CDNA and RDNA take CUDA's FILL.
# TRACED_COLUMNS (the columns a split spans where the launches are traced and the row count is a symbol:
# _column_splits) is 1,024 on every GPU platform, not swept: the partial products then cost 6% of x's reads at rank
# 16 (benchmarks/RESULTS.md, SFT AG).
# CPU (the interpreter): large blocks, so that its Python-level loops are few.
CONFIGS = {
    "cuda": {
        "project": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=4, FILL=2, TRACED_COLUMNS=1024),
        "reduce_rows": dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
        "add_low_rank": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
        "sum_splits": dict(BLOCK=512, num_warps=4),
    },
    "cdna": {
        "project": dict(BLOCK_M=64, BLOCK_K=128, num_warps=2, num_stages=2, FILL=2, TRACED_COLUMNS=1024),
        "reduce_rows": dict(BLOCK_M=32, BLOCK_N=128, num_warps=2, num_stages=2),
        "add_low_rank": dict(BLOCK_M=64, BLOCK_N=128, num_warps=2),
        "sum_splits": dict(BLOCK=512, num_warps=2),
    },
    "rdna": {
        "project": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=2, FILL=2, TRACED_COLUMNS=1024),
        "reduce_rows": dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=2),
        "add_low_rank": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4),
        "sum_splits": dict(BLOCK=512, num_warps=4),
    },
    "cpu": {
        "project": dict(BLOCK_M=128, BLOCK_K=64),
        "reduce_rows": dict(BLOCK_M=64, BLOCK_N=256),
        "add_low_rank": dict(BLOCK_M=128, BLOCK_N=256),
        "sum_splits": dict(BLOCK=4096),
    },
}


# (the kernel's name in CONFIGS, platform, the dtypes, BLOCK_R, device) → the config launched instead of CONFIGS',
# which needed more shared memory than the GPU has: at large ranks, and with fp32 inputs, where every tile is twice
# as large. Whoever changes CONFIGS at run time (benchmarks/lora_configs.py) clears it.
_FITTED = {}


def _fitting(name, platform, key, launch_with):
    """launch_with(config) under CONFIGS[platform][name], or, where Triton finds that the kernel so compiled needs
    more shared memory than the GPU has, under the first smaller config that fits (_smaller). Triton raises that
    at the launch, before anything runs; the config that fit is remembered."""
    # built at every launch: no more than what tells the fits apart, and the kernel by its name (a JITFunction
    # hashes its source at every call)
    key = (name, platform) + key
    config = _FITTED.get(key) or CONFIGS[platform][name]
    while True:
        try:
            return launch_with(config)
        except OutOfResources as error:
            smaller = _smaller(config, error)
            if smaller is None:
                raise
            config = _FITTED[key] = smaller


def _smaller(config, error):
    """Fewer pipeline stages, in proportion to the shared memory wanted over what there is (each stage holds a
    copy of the loop's tiles), or at one stage the largest block (of ≥ 32) halved; None when nothing can shrink.
    Each try compiles the kernel: the proportion saves most of them."""
    stages = config.get("num_stages", 1)
    if stages > 1:
        return {**config, "num_stages": max(1, min(stages - 1, stages * error.limit // error.required))}
    blocks = [name for name, size in config.items() if name.startswith("BLOCK") and size >= 32]
    if not blocks:
        return None
    largest = max(blocks, key=config.get)
    return {**config, largest: config[largest] // 2}


def _block_r(rank):
    return max(16, layout.next_power_of_2(rank))  # tl.dot needs every block dimension ≥ 16


def _split_bf16(t, platform):
    return t.dtype == torch.bfloat16 and platform != "cpu"


def _column_splits(config, programs, widest, device, platform):
    """How many splits of the columns the projections' launch of `programs` programs a split takes: enough for
    config["FILL"] programs a multiprocessor (a program streams its rows' columns with as many loads in flight
    as its tiles and stages hold, so a launch of fewer programs than multiprocessors leaves bandwidth unused), at
    most one a BLOCK_K of the widest input. FILL 0 (or none): one split. The interpreter counts one
    multiprocessor.

    One split too where the host launches each kernel from Python as the step runs (a GPU stream not being
    captured into a CUDA graph): a split adds a launch to sum the partial products, 25–50 µs of the host's time, as
    long as the projection takes on the GPU, in a step whose pace the host sets (under dynamic shapes:
    benchmarks/RESULTS.md, SFT X). A CUDA graph replays its launches at no cost to the host, and there the split
    pays. Traced into a graph (lowering/traced.py), the launch is Inductor's wrapper's, a few µs, but the row
    count is a symbol, which no choice may branch on: the columns split in runs of config["TRACED_COLUMNS"]
    whatever the rows (0 or none: one split). Its partial products then cost at most 2 · 4 · rank bytes a row for
    every TRACED_COLUMNS columns of x read (6% at rank 16, 1,024 bf16 columns), and at 2,300 rows of Llama-3-8B's
    4,096 columns a launch has 144 programs, not 36 (benchmarks/RESULTS.md, SFT AF)."""
    if platform != "cpu" and layout.tracing():
        columns = config.get("TRACED_COLUMNS", 0)
        return layout.cdiv(widest, columns) if columns else 1
    fill = config.get("FILL", 0)
    if not fill or (platform != "cpu" and not layout.capturing()):
        return 1
    wanted = fill * (1 if platform == "cpu" else layout.multiprocessors(device))
    return max(1, min(wanted // max(programs, 1), layout.cdiv(widest, config["BLOCK_K"])))


def _split_size(size, splits, block):
    """The elements of each of `splits` splits of `size`, in whole blocks."""
    return layout.cdiv(layout.cdiv(size, splits), block) * block


def _launch_options(config):
    return {key: value for key, value in config.items() if key not in ("FILL", "TRACED_COLUMNS")}


def _sum_splits(partial, first, second, splits, platform, scale_first=1.0):
    """first, second = scale_first · Σ_split partial[split], Σ_split partial[split], partial[split] holding
    first's elements, then second's."""
    size = partial[0].numel()
    config = CONFIGS[platform]["sum_splits"]
    layout.launcher(_sum_splits_kernel)[(layout.cdiv(size, config["BLOCK"]),)](
        partial, first, second, splits, first.numel(), size, scale_first, **config)


def _project(x_rows, weight, stride_wr, stride_wk, rank, scale):
    """[rows, rank] fp32 = scale · x_rows · Wᵀ, W given as (tensor, strides of its [rank, cols] view): one launch,
    or where a launch over the rows alone leaves the GPU short of programs, one over splits of the columns and a
    second that adds up their partial products."""
    n_rows, n_cols = x_rows.shape
    platform = layout.platform(x_rows)  # once a call: this runs on the host for every launch
    block_r = _block_r(rank)

    def launch(config):
        row_blocks = layout.cdiv(n_rows, config["BLOCK_M"])
        per_split = _split_size(n_cols, _column_splits(config, row_blocks, n_cols, x_rows.device, platform),
                                config["BLOCK_K"])
        splits = layout.cdiv(n_cols, per_split) if n_cols else 1  # none empty
        partial = torch.empty((splits, n_rows, rank), dtype=torch.float32, device=x_rows.device)
        layout.launcher(_project_kernel)[(row_blocks, 1, splits)](
            x_rows, weight, partial, n_rows, n_cols, per_split, rank,
            x_rows.stride(0), stride_wr, stride_wk, n_rows * rank, scale, BLOCK_R=block_r,
            PRECISION=PRECISION[platform], SPLIT_BF16=_split_bf16(x_rows, platform), **_launch_options(config))
        return partial, splits

    partial, splits = _fitting("project", platform, (x_rows.dtype, block_r, x_rows.device), launch)
    if splits == 1:
        return partial[0]
    out = torch.empty((n_rows, rank), dtype=torch.float32, device=x_rows.device)
    # the second output empty: traced, a tensor passed as both outputs would be two results of one launch
    _sum_splits(partial, out, out.new_empty(0), splits, platform)
    return out


def _reduce_rows_pair(rows, grad, xa, grad_xa, scale_b):
    """(grad_xaᵀ · rows [rank, in], scale_b · gradᵀ · xa [out, rank]) fp32, reduced over rows in splits (enough
    programs for both products to fill the GPU) by one launch, whose partial sums a second one adds up and
    scales."""
    n_rows, n_in = rows.shape
    n_out, rank = grad.shape[1], xa.shape[1]
    platform = layout.platform(rows)
    block_r = _block_r(rank)
    # 4 programs per SM (CU on AMD) fill the GPU: 528 on the H200, as tuned; the interpreter's count is fixed
    programs = 512 if platform == "cpu" else 4 * layout.multiprocessors(rows.device)
    size = (n_out + n_in) * rank

    def launch(config):  # the splits follow the config's blocks
        block_m = config["BLOCK_M"]
        out_blocks = layout.cdiv(n_out, config["BLOCK_N"])
        col_blocks = out_blocks + layout.cdiv(n_in, config["BLOCK_N"])
        # The splits follow the weights' sizes alone, not n_rows, which may be a symbolic size (lowering/traced.py):
        # below splits · BLOCK_M rows some splits are empty, and their programs write zeros
        splits = layout.cdiv(programs, col_blocks)
        rows_per_split = _split_size(n_rows, splits, block_m)
        partial = torch.empty((splits, size), dtype=torch.float32, device=rows.device)  # all written
        layout.launcher(_reduce_rows_pair_kernel)[(col_blocks, splits)](
            grad, xa, grad_xa, rows, partial, n_rows, n_out, n_in, rank, rows_per_split, grad.stride(0),
            rows.stride(0), out_blocks, BLOCK_R=block_r, PRECISION=PRECISION[platform],
            SPLIT_BF16_X=_split_bf16(rows, platform), SPLIT_BF16_G=_split_bf16(grad, platform), **config)
        return partial, splits

    key = (rows.dtype, grad.dtype, block_r, rows.device)
    partial, splits = _fitting("reduce_rows", platform, key, launch)
    # two tensors, not views of one buffer: a custom op's outputs may not alias each other
    grad_a = torch.empty((rank, n_in), dtype=torch.float32, device=rows.device)
    grad_b = torch.empty((n_out, rank), dtype=torch.float32, device=rows.device)
    _sum_splits(partial, grad_b, grad_a, splits, platform, scale_b)
    return grad_a, grad_b


def _add_low_rank(xa, weight, stride_wn, stride_wr, scale, out_dtype, n_cols, bias=None, base=None):
    """scale · xa · Wᵀ [rows, n_cols] in out_dtype, W given as (tensor, strides of its [n_cols, rank] view), plus
    bias and base where given, each element rounded once, into a new tensor."""
    n_rows = xa.shape[0]
    platform = layout.platform(xa)
    block_r = _block_r(xa.shape[1])
    out = torch.empty((n_rows, n_cols), dtype=out_dtype, device=xa.device)

    def launch(config):
        grid = (layout.cdiv(n_rows, config["BLOCK_M"]), layout.cdiv(n_cols, config["BLOCK_N"]))
        layout.launcher(_add_low_rank_kernel)[grid](
            xa if base is None else base, xa, weight, xa if bias is None else bias, out, n_rows, n_cols, xa.shape[1],
            0 if base is None else base.stride(0), stride_wn, stride_wr, scale, ADD_BASE=base is not None,
            HAS_BIAS=bias is not None, BLOCK_R=block_r, PRECISION=PRECISION[platform],
            SPLIT_BF16=out_dtype == torch.bfloat16 and platform != "cpu", **config)

    key = (None if base is None else base.dtype, out_dtype, block_r, xa.device)
    _fitting("add_low_rank", platform, key, launch)
    return out


def _matmul_plus_low_rank(a, b, low, weight, stride_wn, stride_wr, scale, bias=None):
    """a·b + scale · low · Wᵀ (+ bias) [rows, n] in a's dtype, W given as (tensor, strides of its [n, rank] view):
    a LoRA layer's output (a·b = x·Wᵀ) or its dX (a·b = dY·W). The low-rank term (and the bias) is written first
    and cuBLAS adds the matmul onto it (β = 1): the output is read again in the epilogue of a compute-bound matmul,
    not in a memory-bound pass of its own. Traced into a graph, the accumulation stays in place
    (lowering/traced.py _accumulate_in_place)."""
    out = _add_low_rank(low, weight, stride_wn, stride_wr, scale, a.dtype, b.shape[1], bias)
    return out.addmm_(a, b)


def supported(x, weight, lora_a, lora_b) -> bool:
    """The kernels compute PEFT's default dtypes: fp32 adapters on a base of x's dtype."""
    return lora_a.dtype == lora_b.dtype and supported_dtypes(x.dtype, weight.dtype, lora_a.dtype)


def supported_dtypes(x_dtype, weight_dtype, adapter_dtype) -> bool:
    return (adapter_dtype == torch.float32 and x_dtype == weight_dtype
            and x_dtype in (torch.float32, torch.bfloat16, torch.float16))


def lora_down_forward(x, lora_a):
    """xa = x·Aᵀ [..., rank] fp32, lora_linear_forward's input, which the backward reads as saved."""
    rows = as_rows(x, x.shape[-1])
    xa = _project(rows, lora_a, lora_a.stride(0), lora_a.stride(1), lora_a.shape[0], 1.0)
    return xa.view(*x.shape[:-1], lora_a.shape[0])


def lora_linear_forward(x, weight, bias, lora_b, xa, scaling, out_dtype):
    """x·Wᵀ + bias + (xa · Bᵀ) · scaling in out_dtype."""
    rows = as_rows(x, x.shape[-1])
    xa = xa.reshape(-1, xa.shape[-1]).contiguous()  # the kernel reads it as [rows, rank] contiguous
    # B is [out, rank]: W[n, r] = B[n, r]
    if out_dtype == rows.dtype:
        out = _matmul_plus_low_rank(rows, weight.t(), xa, lora_b, lora_b.stride(0), lora_b.stride(1), scaling, bias)
    else:  # a wider output (PEFT's 4-bit layer under autocast): the base is rounded to its dtype first, as there
        base = torch.nn.functional.linear(rows, weight, bias)
        out = _add_low_rank(xa, lora_b, lora_b.stride(0), lora_b.stride(1), scaling, out_dtype, weight.shape[0],
                            base=base)
    return out.view(*x.shape[:-1], weight.shape[0])


def lora_linear_backward(grad_out, x, xa, weight, lora_a, lora_b, scaling):
    rows = as_rows(x, x.shape[-1])
    grad = as_rows(grad_out, weight.shape[0])
    # d(xa) = scaling · dY·B [tokens, rank]; B is [out, rank], read as the [rank, out] matrix Bᵀ
    grad_xa = _project(grad, lora_b, lora_b.stride(1), lora_b.stride(0), lora_b.shape[1], scaling)
    # d(xa)ᵀ · x [rank, in], scaling · dYᵀ · xa [out, rank]
    grad_a, grad_b = _reduce_rows_pair(rows, grad, xa.reshape(-1, xa.shape[-1]).contiguous(), grad_xa, scaling)
    # dX = dY·W + d(xa)·A, the low-rank term rounded to x's dtype as autograd's accumulation of two gradients
    # rounds it; A is [rank, in]: W[n, r] = A[r, n]
    grad_x = _matmul_plus_low_rank(grad.to(weight.dtype), weight, grad_xa, lora_a, lora_a.stride(1),
                                   lora_a.stride(0), 1.0)
    return grad_x.view(x.shape), grad_a, grad_b
