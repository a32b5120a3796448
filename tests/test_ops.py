"""The graphopt:: op contract (lowering/ops.py): opcheck, autograd wiring, fake (meta) implementations.

Runs on DEVICE: on CPU the ops run their pure-torch reference body; on CUDA the Triton kernels that
graphopt.lowering.cuda registers for the "cuda" device type. Values are checked against torch's own rms_norm,
which shares no code with graphopt. Inputs are drawn on the CPU (reproducible everywhere), then moved to DEVICE.
"""

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode

import graphopt  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.kernels import rmsnorm as triton_rmsnorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

rms_norm = torch.ops.graphopt.rms_norm
rms_norm_backward = torch.ops.graphopt.rms_norm_backward


def expected_forward(x, w, eps, offset, out_dtype):
    """torch's F.rms_norm in fp64: an implementation independent of graphopt's reference."""
    weight = None if w is None else w.double() + offset
    return F.rms_norm(x.double(), (x.shape[-1],), weight, eps).to(out_dtype)


def _t(shape, dtype=torch.float32, requires_grad=False, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)  # a CPU generator: the draw happens on the CPU, then moves
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return t.requires_grad_(requires_grad)  # after the move, so the tensor on `device` is the leaf


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 on the CPU (either side may live on DEVICE)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


# --- opcheck --------------------------------------------------------------------------------------------

FORWARD_SAMPLES = {
    "weight_fp32": dict(x=((4, 8), torch.float32, True), w=((8,), torch.float32, True), offset=0.0,
                        out=torch.float32),
    "no_weight": dict(x=((2, 3, 16), torch.float32, True), w=None, offset=0.0, out=torch.float32),
    "gemma_offset_bf16_out": dict(x=((5, 12), torch.float32, True), w=((12,), torch.float32, True), offset=1.0,
                                  out=torch.bfloat16),
    "bf16_in_fp32_out_frozen_weight": dict(x=((3, 7, 24), torch.bfloat16, True), w=((24,), torch.bfloat16, False),
                                           offset=0.0, out=torch.float32),
    "weight_grad_only": dict(x=((6, 10), torch.float16, False), w=((10,), torch.float32, True), offset=1.0,
                             out=torch.float16),
    "no_grad_at_all": dict(x=((1, 32), torch.float32, False), w=((32,), torch.float32, False), offset=0.0,
                           out=torch.bfloat16),
    "single_row_1d": dict(x=((9,), torch.float32, True), w=((9,), torch.float32, True), offset=0.0,
                          out=torch.float32),
}


def _forward_args(sample, seed=0):
    x = _t(*sample["x"], seed=seed)
    w = None if sample["w"] is None else _t(*sample["w"], seed=seed + 1)
    return x, w, 1e-6, sample["offset"], sample["out"]


@pytest.mark.parametrize("name", FORWARD_SAMPLES)
def test_opcheck_rms_norm(name):
    args = _forward_args(FORWARD_SAMPLES[name])
    result = torch.library.opcheck(rms_norm, args)
    assert result and set(result.values()) == {"SUCCESS"}, result


BACKWARD_SAMPLES = {
    "with_weight_grad": ((4, 8), torch.float32, torch.float32, (8,), True, 0.0),
    "weight_no_grad": ((4, 8), torch.float32, torch.float32, (8,), False, 1.0),
    "no_weight": ((2, 3, 16), torch.float32, torch.float32, None, False, 0.0),
    "bf16_x_fp32_grad": ((3, 24), torch.bfloat16, torch.float32, (24,), True, 0.0),
    "fp16_gemma": ((2, 2, 10), torch.float16, torch.float16, (10,), True, 1.0),
}


@pytest.mark.parametrize("name", BACKWARD_SAMPLES)
def test_opcheck_rms_norm_backward(name):
    shape, x_dtype, grad_dtype, w_shape, cwg, offset = BACKWARD_SAMPLES[name]
    args = (_t(shape, grad_dtype, seed=1), _t(shape, x_dtype, seed=2),
            None if w_shape is None else _t(w_shape, x_dtype, seed=3), 1e-6, offset, cwg)
    result = torch.library.opcheck(rms_norm_backward, args)
    assert result and set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("op", ["forward", "backward"])
def test_opcheck_non_contiguous_input(op):
    x = _t((8, 6)).t()  # (6, 8), strides (1, 6)
    w = _t((8,), seed=1)
    if op == "forward":
        torch.library.opcheck(rms_norm, (x, w, 1e-6, 0.0, torch.float32))
    else:
        torch.library.opcheck(rms_norm_backward, (_t((8, 6), seed=2).t(), x, w, 1e-6, 0.0, True))


# --- values and autograd --------------------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("has_weight", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_forward_values(offset, has_weight, out_dtype):
    x = _t((3, 5, 64), torch.float32)
    w = _t((64,), seed=1) * 0.3 if has_weight else None
    y = rms_norm(x, w, 1e-5, offset, out_dtype)
    assert y.shape == x.shape and y.dtype == out_dtype
    # Both sides are rounded once from (nearly) exact values, so they agree exactly or to one output ulp (on CUDA
    # the kernel's fp32 math adds a few fp32 ulps, well inside assert_close's fp32 rtol of 1.3e-6).
    torch.testing.assert_close(y, expected_forward(x, w, 1e-5, offset, out_dtype))


# gradcheck and the fp64 comparison with torch stay on the CPU, whatever DEVICE is: there the op runs its
# reference body, which computes fp64 inputs in fp64. The CUDA Triton kernels accept fp64 tensors but upcast only
# to fp32 and compute in fp32, so an fp64 gradcheck (finite differences with eps 1e-6, atol 1e-8) would fail on
# them by design; test_cuda_kernels_match_fp64_reference checks them in fp32 against fp64 instead.

@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("has_weight", [True, False])
def test_gradcheck_fp64(offset, has_weight):
    x = _t((3, 4, 7), torch.float64, requires_grad=True, device="cpu")
    w = (_t((7,), torch.float64, seed=1, device="cpu") * 0.5).requires_grad_(True) if has_weight else None
    inputs = (x, w) if has_weight else (x,)

    def f(x, w=None):
        return rms_norm(x, w, 1e-5, offset, torch.float64)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_grads_match_torch_rms_norm(offset):
    # Same loss through graphopt's op and through F.rms_norm (torch's own autograd), fp64.
    x = _t((2, 5, 33), torch.float64, requires_grad=True, device="cpu")
    w = _t((33,), torch.float64, requires_grad=True, seed=1, device="cpu")
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dy = _t((2, 5, 33), torch.float64, seed=2, device="cpu")

    (rms_norm(x, w, 1e-6, offset, torch.float64) * dy).sum().backward()
    (F.rms_norm(x2, (33,), w2 + offset, 1e-6) * dy).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton kernels are registered for CUDA tensors only")
@pytest.mark.parametrize("shape", [(3, 4, 7), (2, 33, 1000)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("has_weight", [True, False])
def test_cuda_kernels_match_fp64_reference(shape, offset, has_weight, monkeypatch):
    # The op's forward and backward through autograd on CUDA (the Triton kernels, fp32 math) against torch's
    # F.rms_norm and its autograd in fp64 on the CPU: the fp32 bound of DESIGN.md, rel err ≤ 1e-5.
    calls = []
    for name in ("rms_norm_forward", "rms_norm_backward"):
        def spy(*args, _real=getattr(triton_rmsnorm, name), _name=name):
            calls.append(_name)
            return _real(*args)
        monkeypatch.setattr(triton_rmsnorm, name, spy)

    x = _t(shape, torch.float32, requires_grad=True)
    w = (_t(shape[-1:], seed=1) * 0.5 + (0.0 if offset else 1.0)).requires_grad_(True) if has_weight else None
    dy = _t(shape, seed=2)
    y = rms_norm(x, w, 1e-5, offset, torch.float32)
    y.backward(dy)
    assert calls == ["rms_norm_forward", "rms_norm_backward"], "the CUDA dispatch did not reach the Triton kernels"

    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_() if has_weight else None
    y64 = F.rms_norm(x64, shape[-1:], None if w64 is None else w64 + offset, 1e-5)
    y64.backward(dy.cpu().double())
    assert rel_err(y, y64) <= 1e-5
    assert rel_err(x.grad, x64.grad) <= 1e-5
    if has_weight:
        assert rel_err(w.grad, w64.grad) <= 1e-5


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def _backward_calls(recorder):
    return [args for func, args in recorder.calls if func == rms_norm_backward.default]


def test_frozen_weight_gets_no_grad_and_skips_dw():
    x = _t((4, 16), requires_grad=True)
    w = _t((16,), seed=1)  # frozen (the LoRA case)
    y = rms_norm(x, w, 1e-6, 0.0, torch.float32)
    with _RecordOps() as rec:
        y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert w.grad is None
    calls = _backward_calls(rec)
    assert len(calls) == 1
    assert calls[0][-1] is False  # compute_weight_grad: the dW reduction is not even computed


def test_trained_weight_requests_dw():
    x = _t((4, 16), requires_grad=True)
    w = _t((16,), seed=1, requires_grad=True)
    y = rms_norm(x, w, 1e-6, 0.0, torch.float32)
    with _RecordOps() as rec:
        y.sum().backward()
    assert _backward_calls(rec)[0][-1] is True
    assert w.grad is not None and w.grad.shape == w.shape


def test_weight_grad_only_when_x_frozen():
    x = _t((4, 16))
    w = _t((16,), seed=1, requires_grad=True)
    dy = _t((4, 16), seed=2)
    (rms_norm(x, w, 1e-6, 1.0, torch.float32) * dy).sum().backward()
    assert x.grad is None
    x_hat = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(w.grad.double(), (dy.double() * x_hat).sum(0), rtol=1e-5, atol=1e-6)


def test_grad_dtypes_follow_inputs():
    x = _t((3, 24), torch.bfloat16, requires_grad=True)
    w = _t((24,), torch.float32, requires_grad=True, seed=1)
    y = rms_norm(x, w, 1e-6, 0.0, torch.float32)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_no_weight_backward_passes_none():
    x = _t((4, 16), requires_grad=True)
    with _RecordOps() as rec:
        rms_norm(x, None, 1e-6, 0.0, torch.float32).sum().backward()
    (args,) = _backward_calls(rec)
    assert args[2] is None and args[-1] is False
    assert x.grad is not None and torch.isfinite(x.grad).all()


# --- fake implementations -------------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_forward_shapes_and_dtypes(out_dtype):
    with FakeTensorMode():
        x = torch.empty(2, 7, 48, dtype=torch.bfloat16, device=DEVICE)
        w = torch.empty(48, dtype=torch.bfloat16, device=DEVICE)
        y = rms_norm(x, w, 1e-6, 0.0, out_dtype)
        y_nw = rms_norm(x, None, 1e-6, 1.0, out_dtype)
    for out in (y, y_nw):
        assert isinstance(out, torch._subclasses.FakeTensor)
        assert out.shape == (2, 7, 48) and out.dtype == out_dtype and out.device == x.device


@pytest.mark.parametrize("compute_weight_grad", [True, False])
def test_fake_backward_shapes_and_dtypes(compute_weight_grad):
    with FakeTensorMode():
        x = torch.empty(2, 7, 48, dtype=torch.float16, device=DEVICE)
        w = torch.empty(48, dtype=torch.float32, device=DEVICE)
        dy = torch.empty(2, 7, 48, dtype=torch.float32, device=DEVICE)
        dx, dw = rms_norm_backward(dy, x, w, 1e-6, 0.0, compute_weight_grad)
    assert dx.shape == x.shape and dx.dtype == torch.float16
    if compute_weight_grad:
        assert dw.shape == (48,) and dw.dtype == torch.float32
    else:
        assert dw.shape == (0,)


def test_fake_symbolic_shapes():
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def sym(t):
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim()))

    x, dy = sym(torch.randn(3, 5, 8, device=DEVICE)), sym(torch.randn(3, 5, 8, device=DEVICE))
    w = sym(torch.randn(8, device=DEVICE))
    assert all(isinstance(s, torch.SymInt) for s in x.shape)
    with mode:
        y = rms_norm(x, w, 1e-6, 0.0, torch.bfloat16)
        dx, dw = rms_norm_backward(dy, x, w, 1e-6, 0.0, True)
    # The outputs carry the inputs' symbols, not sizes specialised to the example.
    assert [str(s) for s in y.shape] == [str(s) for s in x.shape]
    assert [str(s) for s in dx.shape] == [str(s) for s in x.shape]
    assert [str(s) for s in dw.shape] == [str(s) for s in w.shape]
    assert y.dtype == torch.bfloat16 and dx.dtype == x.dtype


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_dynamic_no_recompile(backend):
    # aot_eager also traces forward and backward with the fake impls on symbolic shapes.
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    w = _t((32,), seed=1, requires_grad=True)

    def f(x, w):
        return rms_norm(x * 2, w, 1e-6, 1.0, torch.float32) + 1

    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for seq in (5, 11, 17):
        x = _t((2, seq, 32), seed=seq, requires_grad=True)
        out = compiled(x, w)
        expected = expected_forward(x * 2, w, 1e-6, 1.0, torch.float32) + 1
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
    assert w.grad is not None and torch.isfinite(w.grad).all()
    torch._dynamo.reset()
