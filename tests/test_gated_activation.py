"""graphopt::gated_activation (SwiGLU / GeGLU): Triton kernels and the op against an fp64 reference, opcheck,
and the fusion pass on Dynamo graphs (exact match counts, numbers unchanged)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import graphopt  # noqa: F401  (registers the graphopt ops)
from graphopt.kernels import gated_activation as kernels
from graphopt.kernels import reference
from graphopt.passes.fuse_swiglu import fuse_swiglu
from graphs import count_calls, first_output, relative_error, run_pass
from test_kernel_rmsnorm import DEVICE, DTYPES, TOL

ACTIVATIONS = ["silu", "gelu_tanh"]
OP = torch.ops.graphopt.gated_activation.default


def inputs(shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    gate, up, dh = (torch.randn(shape, generator=g) * s for s in (scale, 1.0, 1.0))
    return [t.to(DEVICE, dtype) for t in (gate, up, dh)]


def exact(gate, up, dh, activation):
    """fp64 reference, derived by autograd from torch's own activations (independent of reference.py)."""
    g, u = (t.double().requires_grad_() for t in (gate, up))
    act = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
    h = act * u
    h.backward(dh.double())
    return h.detach(), g.grad, u.grad


@settings(max_examples=40)
@given(rows=st.sampled_from([(1,), (7,), (2, 33), (300,)]), hidden=st.sampled_from([1, 64, 123, 1000, 4097]),
       dtype=st.sampled_from(DTYPES), activation=st.sampled_from(ACTIVATIONS), seed=st.integers(0, 1000))
def test_kernels_match_fp64(rows, hidden, dtype, activation, seed):
    gate, up, dh = inputs((*rows, hidden), dtype, seed)
    h = kernels.gated_activation_forward(gate, up, activation)
    dg, du = kernels.gated_activation_backward(dh, gate, up, activation)
    ref_h, ref_dg, ref_du = exact(gate, up, dh, activation)
    # The output is rounded once to dtype (TOL); the gradients twice: two inputs' worth of rounding noise.
    assert h.dtype == dg.dtype == du.dtype == dtype
    assert relative_error(h, ref_h) <= TOL[dtype]
    assert relative_error(dg, ref_dg) <= 2 * TOL[dtype]
    assert relative_error(du, ref_du) <= 2 * TOL[dtype]
    assert_written_over_its_inputs(dh, gate, up, activation, (dg, du))


def assert_written_over_its_inputs(dh, gate, up, activation, expected):
    """The in-place backward (lowering/traced.py traces it where gate and up are read no more): the same numbers
    as the backward's, in gate's and up's own memory where they are contiguous, else in new tensors."""
    g, u = gate.clone(memory_format=torch.preserve_format), up.clone(memory_format=torch.preserve_format)
    dg, du = kernels.gated_activation_backward_in_place(dh, g, u, activation)
    assert torch.equal(dg, expected[0]) and torch.equal(du, expected[1])
    in_place = g.dim() >= 2 and g.is_contiguous() and u.is_contiguous()
    assert (dg.data_ptr() == g.data_ptr() and du.data_ptr() == u.data_ptr()) is in_place


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_chunked_halves_and_extreme_values(activation):
    """Phi-3's gate and up are the two halves of one tensor (row stride 2×hidden); values far into the tails."""
    gate_up = torch.cat([torch.linspace(-60, 60, 6 * 40).reshape(6, 40), torch.randn(6, 40)], -1).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    dh = torch.randn(6, 40, device=DEVICE)
    h = kernels.gated_activation_forward(gate, up, activation)
    dg, du = kernels.gated_activation_backward(dh, gate, up, activation)
    ref_h, ref_dg, ref_du = exact(gate, up, dh, activation)
    assert torch.isfinite(h).all() and torch.isfinite(dg).all()
    assert relative_error(h, ref_h) <= 1e-5 and relative_error(dg, ref_dg) <= 1e-5
    assert relative_error(du, ref_du) <= 1e-5
    assert_written_over_its_inputs(dh, gate, up, activation, (dg, du))


def test_reference_backward_is_the_derivative():
    for activation in ACTIVATIONS:
        gate, up, dh = (t.double() for t in inputs((5, 17), torch.float32, 3))
        _, ref_dg, ref_du = exact(gate, up, dh, activation)
        dg, du = reference.gated_activation_backward(dh, gate, up, activation)
        assert relative_error(dg, ref_dg) <= 1e-12 and relative_error(du, ref_du) <= 1e-12


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(activation, dtype):
    gate, up, dh = inputs((3, 5, 16), dtype, 1)
    gate.requires_grad_(), up.requires_grad_()
    torch.library.opcheck(OP, (gate, up, activation))
    torch.library.opcheck(torch.ops.graphopt.gated_activation_backward.default, (dh, gate.detach(), up.detach(),
                                                                                activation))


def test_op_gradcheck_in_fp64():
    for activation in ACTIVATIONS:  # CPU: the op's body is the reference, fp64 throughout
        gate, up, _ = (t.double().cpu().requires_grad_() for t in inputs((4, 6), torch.float32, 5))
        assert torch.autograd.gradcheck(lambda g, u: OP(g, u, activation), (gate, up))


def test_bad_inputs_are_clear_errors():
    gate, up, _ = inputs((2, 8), torch.float32, 0)
    with pytest.raises(RuntimeError, match="activation 'relu' is not one of"):
        OP(gate, up, "relu")
    with pytest.raises(RuntimeError, match="must have one shape and dtype"):
        OP(gate, up[:, :4], "silu")


# --- the pass ------------------------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self, n, kind):
        super().__init__()
        self.kind = kind
        self.gate_up = torch.nn.Linear(n, 2 * n)
        self.gate, self.up, self.down = (torch.nn.Linear(n, n) for _ in range(3))

    def forward(self, x):
        if self.kind == "phi3":  # one fused projection, chunked
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(up * F.silu(gate))
        if self.kind == "geglu":
            return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))
        if self.kind == "module_silu":
            return self.down(torch.nn.SiLU()(self.gate(x)) * self.up(x))
        return self.down(F.silu(self.gate(x)) * self.up(x))




@pytest.mark.parametrize("kind, pattern", [("swiglu", "swiglu"), ("module_silu", "swiglu"), ("geglu", "geglu"),
                                           ("phi3", "swiglu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_fuses_every_mlp(kind, pattern, dtype):
    model = torch.nn.Sequential(MLP(24, kind), MLP(24, kind)).to(dtype)
    gm, example, expected, report, fused = run_pass(fuse_swiglu, model, torch.randn(2, 5, 24, dtype=dtype))
    assert fused == 2 == count_calls(gm, OP) and count_calls(gm, F.silu) + count_calls(gm, F.gelu) == 0
    assert [r.pattern for r in report.fusions] == [pattern] * 2 and report.misses == []
    assert [r.module for r in report.fusions] == ["0", "1"]
    tolerance = 1e-6 if dtype == torch.float32 else 2 * 2 ** -8
    assert relative_error(first_output(gm, example), expected) <= tolerance


class ExactGelu(torch.nn.Module):
    def forward(self, g, u):
        return F.gelu(g) * u


class ActivationReused(torch.nn.Module):
    def forward(self, g, u):
        a = F.silu(g)
        return a * u + a


class Broadcast(torch.nn.Module):
    def forward(self, g, u):
        return F.silu(g) * u[:1]


class Scaled(torch.nn.Module):
    def forward(self, g, u):
        return F.silu(g) * 2.0 + u


@pytest.mark.parametrize("model, reason", [
    (ExactGelu(), "only the tanh approximation"),
    (ActivationReused(), "also used outside the product"),
    (Broadcast(), "shapes differ"),
    (Scaled(), "multiplied by a constant"),
])
def test_unprovable_products_stay_unfused_with_a_reason(model, reason):
    gm, example, expected, report, fused = run_pass(fuse_swiglu, model, torch.randn(4, 8), torch.randn(4, 8))
    assert fused == 0 and count_calls(gm, OP) == 0
    assert len(report.misses) == 1 and reason in report.misses[0].reason
    torch.testing.assert_close(first_output(gm, example), expected, rtol=0, atol=0)
