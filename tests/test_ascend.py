"""lowering/ascend.py end to end on the CPU: the graphopt ops composed from torch_npu's fused operators, run
against a stand-in of those operators with their exact schemas (tests/npu_standin.py; torch_npu is never
installed here), compared with the fp64 reference; and tiny models trained through the pipeline on the Ascend
lowering, equal to eager."""

import pytest
import torch
from hypothesis import given, strategies as st

import npu_standin
from graphs import relative_error
from graphopt.kernels import reference
from graphopt.lowering import ascend, registry
from models import tiny_lora_model
from test_end_to_end import compile_and_compare

pytestmark = pytest.mark.skipif(npu_standin.importlib.util.find_spec("torch_npu") is not None,
                                reason="torch_npu is installed: these tests need its stand-in")


@pytest.fixture(scope="module")
def npu_ops():
    library = npu_standin.define()
    yield
    library._destroy()


@pytest.fixture(scope="module")
def ascend_on_cpu(npu_ops):
    """The Ascend kernels serve the graphopt ops on CPU tensors, for this module's tests."""
    library = ascend.register("CPU")
    yield
    library._destroy()


def close(got, want, dtype):
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    bound = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    return all(relative_error(g.double(), w.double()) <= bound for g, w in zip(got, want, strict=True) if w.numel())


def in_fp64(*args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else
            (torch.float64 if isinstance(a, torch.dtype) else a) for a in args]


@pytest.mark.parametrize("name, schema", list(npu_standin.SCHEMAS.items()))
def test_standin_ops_have_the_exact_schemas_and_pass_opcheck(name, schema, npu_ops):
    op = getattr(torch.ops.npu, name).default
    assert str(op._schema) == str(torch._C.parse_schema("npu::" + schema))
    g = torch.Generator().manual_seed(0)
    x, gamma = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    q, r1, r2 = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 1, 4, 8, generator=g), torch.randn(2, 1, 4, 8,
                                                                                                        generator=g)
    args = {
        "npu_rms_norm": (x, gamma, 1e-6),
        "npu_rms_norm_backward": (torch.randn(4, 8, generator=g), x, gamma, npu_standin.npu_rms_norm(x, gamma)[1]),
        "npu_rotary_mul": (q, r1, r2, "half"),
        "npu_rotary_mul_backward": (torch.randn(2, 3, 4, 8, generator=g), q, r1, r2, "half"),
        "npu_swiglu": (x, -1),
        "npu_swiglu_backward": (torch.randn(4, 4, generator=g), x, -1),
        "npu_cross_entropy_loss": (x, torch.tensor([1, 7, -100, 0]), None, "mean", -100),
    }[name]
    torch.library.opcheck(op, args)


@given(rows=st.integers(1, 12), hidden=st.sampled_from([16, 64]), dtype=st.sampled_from([torch.float32,
       torch.bfloat16]), offset=st.sampled_from([0.0, 1.0]), with_weight=st.booleans())
def test_rms_norm_and_backward_match_fp64(rows, hidden, dtype, offset, with_weight, ascend_on_cpu):
    g = torch.Generator().manual_seed(rows * hidden)
    x, dy = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype) if with_weight else None
    assert close(torch.ops.graphopt.rms_norm(x, w, 1e-6, offset, dtype),
                 reference.rms_norm(*in_fp64(x, w, 1e-6, offset, dtype)), dtype)
    got = torch.ops.graphopt.rms_norm_backward(dy, x, w, 1e-6, offset, with_weight)
    assert close(got, reference.rms_norm_backward(*in_fp64(dy, x, w, 1e-6, offset, with_weight)), dtype)


@given(q_k_heads=st.sampled_from([(4, 2), (4, 4), (2, 1)]), seq=st.integers(1, 9), head_dim=st.sampled_from([8, 32]),
       partial=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), cos_batch=st.sampled_from([1, 2]))
def test_rope_and_backward_match_fp64(q_k_heads, seq, head_dim, partial, dtype, cos_batch, ascend_on_cpu):
    g = torch.Generator().manual_seed(seq * head_dim)
    rot = head_dim // 2 if partial else head_dim
    q, k = (torch.randn(2, h, seq, head_dim, generator=g).to(dtype) for h in q_k_heads)
    angles = torch.randn(cos_batch, seq, rot // 2, generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    assert close(torch.ops.graphopt.rope(q, k, cos, sin), reference.rope(*in_fp64(q, k, cos, sin)), dtype)
    assert close(torch.ops.graphopt.rope_backward(q, k, cos, sin),
                 reference.rope_backward(*in_fp64(q, k, cos, sin)), dtype)


@given(rows=st.integers(1, 9), width=st.sampled_from([8, 64]), activation=st.sampled_from(["silu", "gelu_tanh"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_gated_activation_and_backward_match_fp64(rows, width, activation, dtype, ascend_on_cpu):
    g = torch.Generator().manual_seed(rows * width)
    gate, up, dh = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(3))
    assert close(torch.ops.graphopt.gated_activation(gate, up, activation),
                 reference.gated_activation(*in_fp64(gate, up, activation)), dtype)
    assert close(torch.ops.graphopt.gated_activation_backward(dh, gate, up, activation),
                 reference.gated_activation_backward(*in_fp64(dh, gate, up, activation)), dtype)


@given(rows=st.integers(1, 10), chunk=st.sampled_from([1, 3, 16]), reduction=st.sampled_from(["mean", "sum"]),
       softcap=st.sampled_from([0.0, 5.0]), ignored=st.integers(0, 3), dtype=st.sampled_from([torch.float32,
       torch.bfloat16]))
def test_linear_cross_entropy_matches_fp64(rows, chunk, reduction, softcap, ignored, dtype, ascend_on_cpu):
    g = torch.Generator().manual_seed(rows * chunk + ignored)
    hidden, weight = torch.randn(rows, 16, generator=g).to(dtype), torch.randn(40, 16, generator=g).to(dtype)
    target = torch.randint(0, 40, (rows,), generator=g)
    target[:ignored] = -100
    args = (hidden, weight, None, target, -100, reduction, softcap, chunk, True, True)
    got = torch.ops.graphopt.linear_cross_entropy(*args)
    want = reference.linear_cross_entropy(*in_fp64(*args))
    if ignored >= rows and reduction == "mean":  # no valid row: NaN loss, as F.cross_entropy
        assert got[0].isnan() and want[0].isnan()
        got, want = got[1:], want[1:]
    assert close(got, want, dtype)


@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3"])
def test_models_train_on_the_ascend_lowering_as_eager(arch, ascend_on_cpu, monkeypatch):
    import graphopt.pipeline

    monkeypatch.setattr(graphopt.pipeline, "resolve_target", lambda requested, inputs: "npu")
    model = tiny_lora_model(arch)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    report = compile_and_compare(model, ids, torch.float32)
    assert report.target == "npu"
    lines = {r.op: r.implementation for r in report.lowering}
    assert "npu_rms_norm" in lines["graphopt.rms_norm.default"]
    assert "npu_rotary_mul" in lines["graphopt.rope.default"]
    assert "npu_cross_entropy_loss" in lines["graphopt.linear_cross_entropy.default"]
    assert registry.lowering_for("npu").note.startswith("Ascend")
