"""Triton RMSNorm kernels (kernels/rmsnorm.py) against the fp64 reference (kernels/reference.py).

Runs compiled on CUDA tensors when a GPU is there, else on CPU tensors through the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 only without a GPU). The interpreter computes bf16 wrong, so bfloat16
is tested on CUDA only; float32 and float16 everywhere. Inputs are drawn on the CPU (a CPU generator, the same
values on every machine) and then moved to DEVICE.

Error measure: ‖out − ref‖ / ‖ref‖ against the reference evaluated in float64 on the same (exactly upcast)
inputs, so the reference is exact up to ~1e-16 and all the error is the kernel's.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphopt.kernels import reference, rmsnorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# With eps == 0 the all-zero padding rows of a partial tile compute 0 · inf = NaN (the interpreter's numpy warns;
# compiled CUDA code does not); they are masked out of every store, which the value checks below verify.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

# fp32 math, fp32 result: DESIGN.md's bound for fp32.
FP32_TOL = 1e-5
# fp16 result: the kernel computes in fp32 and rounds once. Round-to-nearest into fp16 (11-bit significand) moves
# each element by at most u = 2**-11 ≈ 4.9e-4 of its magnitude, so ‖round(y) − y‖ ≤ u·‖y‖ (fp16 subnormals add
# at most 2**-25 absolute per element, negligible next to ‖y‖ here). The fp32 math before the rounding adds well
# under 1e-5. So a correct kernel stays below u + 1e-5 ≈ 5.0e-4, and anything above it is a real error (an fp16
# intermediate, e.g. squaring in fp16, is caught by this bound in the tests below).
FP16_TOL = 2.0 ** -11 + 1e-5
# bf16 result, same argument: bf16 has an 8-bit significand (7 stored bits + the implicit one), so round-to-nearest
# moves each element by at most u = 2**-8 ≈ 3.9e-3 of its magnitude (half the spacing 2**-7 between 1 and the next
# bf16). bf16 has fp32's exponent range, so no subnormal term for these magnitudes. A correct kernel stays below
# u + 1e-5 ≈ 3.9e-3.
BF16_TOL = 2.0 ** -8 + 1e-5
TOL = {torch.float32: FP32_TOL, torch.float16: FP16_TOL, torch.bfloat16: BF16_TOL}
# Dtypes of x (and of the output and weight where those follow x) under test: bf16 only compiled on CUDA.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

HIDDEN = [3, 8, 64, 123, 128, 1000, 1024, 4096, 4097]
EPS = [1e-6, 1e-5, 1e-12, 0.0]  # eps 0 with random (never all-zero) rows is well defined
MAX_ROWS = 600


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    return diff / scale if scale > 0 else diff


def ref_forward(x, w, eps, offset):
    return reference.rms_norm(x.double(), None if w is None else w.double(), eps, offset, torch.float64)


def ref_backward(dy, x, w, eps, offset, compute_weight_grad):
    return reference.rms_norm_backward(dy.double(), x.double(), None if w is None else w.double(), eps, offset,
                                       compute_weight_grad)


@st.composite
def leading_shapes(draw, max_rows=MAX_ROWS):
    """Leading dims (all but hidden): () or (1,) for a single row, up to 3 dims, at most max_rows rows in all."""
    ndim = draw(st.integers(0, 3))
    shape, rows = [], 1
    for _ in range(ndim):
        d = draw(st.integers(1, max_rows // rows))
        shape.append(d)
        rows *= d
    return tuple(shape)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    hidden = draw(st.sampled_from(HIDDEN))
    lead = draw(leading_shapes())
    has_weight = draw(st.booleans())
    return dict(
        shape=lead + (hidden,),
        dtype=dtype,
        weight_dtype=draw(st.sampled_from([dtype, torch.float32])) if has_weight else None,
        eps=draw(st.sampled_from(EPS)),
        offset=draw(st.sampled_from([0.0, 1.0])),
        out_dtype=draw(st.sampled_from([dtype, torch.float32])),
        compute_weight_grad=has_weight and draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def make_inputs(shape, dtype, weight_dtype, offset, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)
    w = None
    if weight_dtype is not None:
        # Gemma-style (offset 1) weights sit around 0, Llama-style around 1; both get a real spread.
        w = torch.randn(shape[-1], generator=g, dtype=torch.float64) * 0.5 + (0.0 if offset else 1.0)
        w = w.to(weight_dtype).to(DEVICE)
    return x, w, g


# --- forward --------------------------------------------------------------------------------------------

@settings(max_examples=60)  # cheap: most cases are small, so afford more of them
@given(cases())
def test_forward_matches_fp64_reference(case):
    x, w, _ = make_inputs(case["shape"], case["dtype"], case["weight_dtype"], case["offset"], case["seed"])
    y = rmsnorm.rms_norm_forward(x, w, case["eps"], case["offset"], case["out_dtype"])

    assert y.shape == x.shape and y.dtype == case["out_dtype"]
    ref = ref_forward(x, w, case["eps"], case["offset"])
    err = rel_err(y, ref)
    assert err <= TOL[case["out_dtype"]], f"rel err {err:.3g} for {case}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_error_bound_is_tight_enough_to_catch_fp16_output_of_fp32_request(dtype):
    # The fp32 bound must reject a result that went through fp16: guards the tolerances themselves.
    x, w, _ = make_inputs((64, 1024), dtype, dtype, 0.0, 0)
    ref = ref_forward(x, w, 1e-6, 0.0)
    assert rel_err(ref.to(torch.float16), ref) > FP32_TOL
    assert rel_err(ref.to(torch.float16), ref) <= FP16_TOL
    assert rel_err(ref.to(torch.bfloat16), ref) > FP16_TOL
    assert rel_err(ref.to(torch.bfloat16), ref) <= BF16_TOL


def test_forward_large_number_of_rows():
    # Many programs (and several row tiles per program on CPU); every row must be written.
    x, w, _ = make_inputs((20000, 128), torch.float32, torch.float32, 0.0, 1)
    y = rmsnorm.rms_norm_forward(x, w, 1e-6, 0.0, torch.float32)
    ref = ref_forward(x, w, 1e-6, 0.0)
    assert rel_err(y, ref) <= FP32_TOL
    # A per-row check too: an unwritten tail row would hide in the global norm of 20000 rows.
    row_err = ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert row_err <= FP32_TOL


@pytest.mark.parametrize("shape", [(5,), (1, 5), (1, 1, 4097)])
def test_forward_single_row(shape):
    x, w, _ = make_inputs(shape, torch.float32, torch.float32, 0.0, 2)
    y = rmsnorm.rms_norm_forward(x, w, 1e-6, 0.0, torch.float32)
    assert y.shape == shape
    assert rel_err(y, ref_forward(x, w, 1e-6, 0.0)) <= FP32_TOL


# --- backward -------------------------------------------------------------------------------------------

@settings(max_examples=60)
@given(cases())
def test_backward_matches_fp64_reference(case):
    x, w, g = make_inputs(case["shape"], case["dtype"], case["weight_dtype"], case["offset"], case["seed"])
    # Under autograd the incoming gradient has the forward's output dtype.
    dy = torch.randn(case["shape"], generator=g, dtype=torch.float64).to(case["out_dtype"]).to(DEVICE)
    cwg = case["compute_weight_grad"]

    dx, dw = rmsnorm.rms_norm_backward(dy, x, w, case["eps"], case["offset"], cwg)
    ref_dx, ref_dw = ref_backward(dy, x, w, case["eps"], case["offset"], cwg)

    assert dx.shape == x.shape and dx.dtype == x.dtype
    err = rel_err(dx, ref_dx)
    assert err <= TOL[x.dtype], f"dx rel err {err:.3g} for {case}"
    if cwg:
        assert dw.shape == w.shape and dw.dtype == w.dtype
        err = rel_err(dw, ref_dw)
        assert err <= TOL[w.dtype], f"dW rel err {err:.3g} for {case}"
    else:
        assert dw.numel() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_weight_grad_is_sum_over_rows(dtype, offset):
    # dW = Σ_rows dy · x̂, checked against an independent formula (not the reference's) over 3-D input.
    x, w, g = make_inputs((3, 37, 123), dtype, dtype, offset, 3)
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    _, dw = rmsnorm.rms_norm_backward(dy, x, w, 1e-6, offset, True)

    xd = x.double()
    x_hat = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (dy.double() * x_hat).sum(dim=(0, 1))
    assert dw.shape == (123,) and dw.dtype == dtype
    assert rel_err(dw, expected) <= TOL[dtype]


def test_weight_grad_empty_when_not_requested():
    x, w, g = make_inputs((17, 64), torch.float32, torch.float32, 0.0, 4)
    dy = torch.randn(x.shape, generator=g).to(DEVICE)
    dx, dw = rmsnorm.rms_norm_backward(dy, x, w, 1e-6, 0.0, False)
    assert isinstance(dw, torch.Tensor) and dw.numel() == 0 and dw.shape == (0,)
    # dx does not depend on whether dW is computed.
    dx_with, _ = rmsnorm.rms_norm_backward(dy, x, w, 1e-6, 0.0, True)
    torch.testing.assert_close(dx, dx_with, rtol=0, atol=0)


def test_backward_large_number_of_rows():
    x, w, g = make_inputs((20000, 128), torch.float32, torch.float32, 1.0, 5)
    dy = torch.randn(x.shape, generator=g).to(DEVICE)
    dx, dw = rmsnorm.rms_norm_backward(dy, x, w, 1e-6, 1.0, True)
    ref_dx, ref_dw = ref_backward(dy, x, w, 1e-6, 1.0, True)
    assert rel_err(dx, ref_dx) <= FP32_TOL
    row_err = ((dx.double() - ref_dx).norm(dim=-1) / ref_dx.norm(dim=-1)).max().item()
    assert row_err <= FP32_TOL
    assert rel_err(dw, ref_dw) <= FP32_TOL


# --- layouts and sizes ----------------------------------------------------------------------------------

def _non_contiguous(kind, rows, hidden, dtype, g):
    # The view is taken on DEVICE: moving a strided view to another device would copy it densely.
    def base(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    if kind == "slice_of_wider_rows":  # stride(-1) == 1, row stride 2*hidden: read in place
        return base(rows, 2 * hidden)[:, :hidden]
    if kind == "transposed":  # stride(-1) != 1: must be copied
        return base(hidden, rows).t()
    if kind == "unmergeable_3d":  # leading dims that no single row stride describes
        return base(rows, 3, hidden).transpose(0, 1)
    if kind == "every_other_row":
        return base(2 * rows, hidden)[::2]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["slice_of_wider_rows", "transposed", "unmergeable_3d", "every_other_row"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input(kind, dtype):
    g = torch.Generator().manual_seed(6)
    x = _non_contiguous(kind, 19, 123, dtype, g)
    dy = _non_contiguous(kind, 19, 123, dtype, g)
    assert not x.is_contiguous() and not dy.is_contiguous()
    w = (torch.randn(123, generator=g) + 1).to(dtype).to(DEVICE)

    y = rmsnorm.rms_norm_forward(x, w, 1e-6, 0.0, dtype)
    assert y.shape == x.shape
    assert rel_err(y, ref_forward(x, w, 1e-6, 0.0)) <= TOL[dtype]

    dx, dw = rmsnorm.rms_norm_backward(dy, x, w, 1e-6, 0.0, True)
    ref_dx, ref_dw = ref_backward(dy, x, w, 1e-6, 0.0, True)
    assert dx.shape == x.shape
    assert rel_err(dx, ref_dx) <= TOL[dtype]
    assert rel_err(dw, ref_dw) <= TOL[dtype]


def test_non_contiguous_weight():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, generator=g).to(DEVICE)
    w = torch.randn(128, generator=g).to(DEVICE)[::2]  # e.g. a weight sliced out of a packed parameter
    y = rmsnorm.rms_norm_forward(x, w, 1e-6, 0.0, torch.float32)
    assert rel_err(y, ref_forward(x, w, 1e-6, 0.0)) <= FP32_TOL
    dy = torch.randn(8, 64, generator=g).to(DEVICE)
    dx, _ = rmsnorm.rms_norm_backward(dy, x, w, 1e-6, 0.0, True)
    assert rel_err(dx, ref_backward(dy, x, w, 1e-6, 0.0, True)[0]) <= FP32_TOL


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 123)])
@pytest.mark.parametrize("compute_weight_grad", [True, False])
def test_zero_rows(shape, compute_weight_grad):
    x = torch.randn(shape, device=DEVICE)
    w = torch.randn(shape[-1], device=DEVICE)
    y = rmsnorm.rms_norm_forward(x, w, 1e-6, 0.0, torch.float16)
    assert y.shape == shape and y.dtype == torch.float16

    dx, dw = rmsnorm.rms_norm_backward(torch.randn(shape, device=DEVICE), x, w, 1e-6, 0.0, compute_weight_grad)
    assert dx.shape == shape and dx.dtype == x.dtype
    if compute_weight_grad:
        # No rows: dW is an exact zero sum, not uninitialised memory.
        assert dw.shape == w.shape and dw.dtype == w.dtype
        assert torch.equal(dw, torch.zeros_like(w))
    else:
        assert dw.numel() == 0


@pytest.mark.parametrize("rows", [1, 5, 999])
def test_eps_zero_with_partial_row_tiles(rows):
    # Row counts that leave padding rows in the last tile: padding rows are all-zero, so with eps == 0 their
    # rstd is inf; they must not leak NaN into the stored rows or into dW.
    x, w, g = make_inputs((rows, 96), torch.float32, torch.float32, 0.0, 10)
    dy = torch.randn(x.shape, generator=g).to(DEVICE)
    y = rmsnorm.rms_norm_forward(x, w, 0.0, 0.0, torch.float32)
    assert rel_err(y, ref_forward(x, w, 0.0, 0.0)) <= FP32_TOL
    dx, dw = rmsnorm.rms_norm_backward(dy, x, w, 0.0, 0.0, True)
    ref_dx, ref_dw = ref_backward(dy, x, w, 0.0, 0.0, True)
    assert torch.isfinite(dw).all()
    assert rel_err(dx, ref_dx) <= FP32_TOL
    assert rel_err(dw, ref_dw) <= FP32_TOL


def test_hidden_size_above_limit_is_refused():
    x = torch.empty(1, rmsnorm.MAX_HIDDEN + 1, device=DEVICE)
    with pytest.raises(ValueError, match="hidden size"):
        rmsnorm.rms_norm_forward(x, None, 1e-6, 0.0, torch.float32)
    with pytest.raises(ValueError, match="hidden size"):
        rmsnorm.rms_norm_backward(x, x, None, 1e-6, 0.0, False)


# --- edge values ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_weight", [True, False])
def test_all_zero_row_is_finite(dtype, has_weight):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 123, generator=g).to(dtype).to(DEVICE)
    x[2] = 0
    w = (torch.randn(123, generator=g) + 1).to(dtype).to(DEVICE) if has_weight else None
    dy = torch.randn(6, 123, generator=g).to(dtype).to(DEVICE)

    y = rmsnorm.rms_norm_forward(x, w, 1e-6, 0.0, dtype)
    assert torch.isfinite(y).all()
    assert torch.equal(y[2], torch.zeros_like(y[2]))
    assert rel_err(y, ref_forward(x, w, 1e-6, 0.0)) <= TOL[dtype]

    dx, dw = rmsnorm.rms_norm_backward(dy, x, w, 1e-6, 0.0, has_weight)
    ref_dx, ref_dw = ref_backward(dy, x, w, 1e-6, 0.0, has_weight)
    assert torch.isfinite(dx).all()
    # Zero row: x̂ = 0, so dx = rstd · g = dy · w / sqrt(eps), large but finite.
    assert rel_err(dx[2], ref_dx[2]) <= TOL[dtype]
    assert rel_err(dx, ref_dx) <= TOL[dtype]
    if has_weight:
        assert torch.isfinite(dw).all() and rel_err(dw, ref_dw) <= TOL[dtype]


@pytest.mark.parametrize(
    "dtype,scale,eps",
    [
        (torch.float32, 1e4, 1e-6),  # x² ~ 1e8: fine in fp32 math
        (torch.float16, 1e4, 1e-6),  # x near fp16's max (65504); squares only exist in fp32
        (torch.float32, 1e-6, 1e-12),  # mean(x²) ~ 1e-12, same size as eps
        (torch.float32, 1e-25, 1e-6),  # x² underflows in fp32; eps dominates, y ≈ x / sqrt(eps)
        (torch.float16, 1e-3, 1e-12),  # mean(x²) ~ 1e-6: would be fp16-subnormal if squared in fp16
        (torch.float16, 2e-5, 1e-6),  # x itself fp16-subnormal
    ] + ([
        (torch.bfloat16, 1e15, 1e-6),  # far beyond fp16's range; x² ~ 1e30 still fits fp32
        (torch.bfloat16, 1e-20, 1e-6),  # x² ~ 1e-40 underflows in fp32; eps dominates
    ] if DEVICE == "cuda" else []),
)
def test_extreme_magnitudes(dtype, scale, eps):
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(33, 1000, generator=g, dtype=torch.float64) * scale)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype).to(DEVICE)
    w = (torch.randn(1000, generator=g) * 0.5 + 1).to(dtype).to(DEVICE)
    dy = torch.randn(33, 1000, generator=g).to(dtype).to(DEVICE)

    y = rmsnorm.rms_norm_forward(x, w, eps, 0.0, dtype)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref_forward(x, w, eps, 0.0)) <= TOL[dtype]

    dx, dw = rmsnorm.rms_norm_backward(dy, x, w, eps, 0.0, True)
    ref_dx, ref_dw = ref_backward(dy, x, w, eps, 0.0, True)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    assert rel_err(dx, ref_dx) <= TOL[dtype]
    assert rel_err(dw, ref_dw) <= TOL[dtype]
