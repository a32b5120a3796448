import operator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphopt.passes.normalize import normalize
from graphs import capture, count_calls

SQUARES = {
    "pow": lambda x: x.pow(2),
    "pow_float": lambda x: torch.pow(x, 2.0),
    "operator_pow": lambda x: x ** 2,
    "mul_self": lambda x: x * x,
    "torch_square": lambda x: torch.square(x),
    "method_square": lambda x: x.square(),
}
INVERSE_ROOTS = {
    "rsqrt": lambda v: torch.rsqrt(v),
    "method_rsqrt": lambda v: v.rsqrt(),
    "one_over_sqrt": lambda v: 1 / torch.sqrt(v),
    "reciprocal_sqrt": lambda v: torch.reciprocal(v.sqrt()),
    "pow_minus_half": lambda v: v ** -0.5,
}
UPCASTS = {
    "float": lambda x: x.float(),
    "to_dtype": lambda x: x.to(torch.float32),
    "to_kw": lambda x: x.to(dtype=torch.float32),
    "type": lambda x: x.type(torch.float32),
}


@given(square=st.sampled_from(sorted(SQUARES)), root=st.sampled_from(sorted(INVERSE_ROOTS)),
       upcast=st.sampled_from(sorted(UPCASTS)), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_spellings_become_one(square, root, upcast, dtype):
    def f(x):
        xf = UPCASTS[upcast](x)
        return INVERSE_ROOTS[root](SQUARES[square](xf).mean(-1, keepdim=True) + 1e-6) * xf

    x = torch.randn(3, 8, dtype=dtype)
    gm, inputs = capture(f, x)
    expected = gm(*inputs)
    normalize(gm)
    assert count_calls(gm, torch.pow) == 1 and count_calls(gm, torch.rsqrt) == 1
    assert count_calls(gm, torch.sqrt) == 0 and count_calls(gm, operator.pow) == 0
    casts = [n for n in gm.graph.nodes if n.op == "call_method"]
    # fp32 input: the upcast is a no-op and is dropped; bf16: exactly one canonical .to(float32)
    assert [(n.target, n.args[1:]) for n in casts] == ([] if dtype == torch.float32 else [("to", (torch.float32,))])
    torch.testing.assert_close(gm(*inputs), expected, rtol=1e-6, atol=1e-6)


def test_operators_become_torch_functions_and_scalars_move_right():
    def f(x):
        return (2.0 * x + 1.0) - (3.0 - x) / x.sum(-1, keepdim=True)

    gm, inputs = capture(f, torch.randn(4, 5))
    expected = gm(*inputs)
    normalize(gm)
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert operator.mul not in targets and operator.add not in targets and operator.sub not in targets
    mul = next(n for n in gm.graph.nodes if n.target is torch.mul)
    assert isinstance(mul.args[0], torch.fx.Node) and mul.args[1] == 2.0
    assert torch.rsub in targets and torch.div in targets
    torch.testing.assert_close(gm(*inputs), expected)


def test_division_by_sqrt_becomes_multiplication_by_rsqrt():
    gm, inputs = capture(lambda x, v: x / torch.sqrt(v), torch.randn(4, 5), torch.rand(4, 1) + 0.5)
    expected = gm(*inputs)
    normalize(gm)
    assert count_calls(gm, torch.sqrt) == 0 and count_calls(gm, torch.rsqrt) == 1 and count_calls(gm, torch.mul) == 1
    torch.testing.assert_close(gm(*inputs), expected)


@pytest.mark.parametrize("spelling", ["half", "type_as", "to_same_device"])
def test_other_casts(spelling):
    def f(x, y):
        if spelling == "half":
            return x.half()
        if spelling == "type_as":
            return x.type_as(y)
        return x.to(device=x.device)

    gm, inputs = capture(f, torch.randn(4), torch.randn(4, dtype=torch.float16))
    normalize(gm)
    calls = [(n.target, n.args[1:]) for n in gm.graph.nodes if n.op == "call_method"]
    assert calls == ([] if spelling == "to_same_device" else [("to", (torch.float16,))])


def test_symbolic_integer_arithmetic_is_left_alone():
    def f(x):
        return x.new_zeros(x.shape[0] + 1) + 1

    torch._dynamo.reset()
    graphs = []
    torch.compile(f, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)(torch.randn(5))
    gm = graphs[0]
    before = [n.target for n in gm.graph.nodes if n.target is operator.add and not isinstance(
        n.meta.get("example_value"), torch.Tensor)]
    normalize(gm)
    after = [n.target for n in gm.graph.nodes if n.target is operator.add]
    assert before and after == before


def test_operator_methods_become_operators():
    """x.__eq__(y), as Dynamo records some comparisons (transformers 5.17's packed mask), reads as x == y."""
    def f(x, y):
        return x.__le__(y).__and__(x.__eq__(y)), x.__getitem__(0)

    gm, inputs = capture(f, torch.arange(4), torch.tensor([0, 2, 2, 1]))
    expected = gm(*inputs)
    normalize(gm)
    assert not [n for n in gm.graph.nodes if n.op == "call_method"]
    assert {count_calls(gm, op) for op in (operator.le, operator.and_, operator.eq, operator.getitem)} == {1}
    assert all(torch.equal(a, b) for a, b in zip(gm(*inputs), expected))
