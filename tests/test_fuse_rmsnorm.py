"""The RMSNorm pass on the graphs Dynamo hands over: exact match counts, and the graph's numbers unchanged."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import graphopt  # noqa: F401  (registers graphopt::rms_norm)
from graphopt.passes.fuse_rmsnorm import fuse_rmsnorm
from graphs import count_calls, first_output, relative_error, run_pass

FUSED = torch.ops.graphopt.rms_norm.default
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # a few ulps of the output


class LlamaStyle(torch.nn.Module):  # Llama, Qwen2, Mistral, Phi-3: cast back, then times weight
    def __init__(self, n, eps=1e-6, square=lambda x: x.pow(2), upcast=lambda x: x.to(torch.float32)):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))
        self.eps, self.square, self.upcast = eps, square, upcast

    def forward(self, x):
        h = self.upcast(x)
        h = h * torch.rsqrt(self.square(h).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaStyle(torch.nn.Module):  # fp32 multiply by (1 + weight), then cast
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.1)
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Functional(torch.nn.Module):
    def __init__(self, n, eps=1e-6, weight=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n)) if weight else None
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Stack(torch.nn.Module):
    """Norms between linears, like a decoder: residual adds keep each norm's input used elsewhere."""

    def __init__(self, norms, n):
        super().__init__()
        self.norms = torch.nn.ModuleList(norms)
        self.linears = torch.nn.ModuleList(torch.nn.Linear(n, n) for _ in norms)

    def forward(self, x):
        for norm, linear in zip(self.norms, self.linears):
            x = x + linear(norm(x))
        return x




SQUARES = [lambda x: x.pow(2), lambda x: x * x, lambda x: x ** 2, torch.square]
UPCASTS = [lambda x: x.float(), lambda x: x.to(torch.float32), lambda x: x.to(dtype=torch.float32)]


@settings(max_examples=15)
@given(kinds=st.lists(st.sampled_from(["llama", "gemma", "functional", "functional_no_weight"]), min_size=1,
                      max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       hidden=st.sampled_from([8, 33, 64]), eps=st.sampled_from([1e-6, 1e-5]),
       square=st.sampled_from(range(len(SQUARES))), upcast=st.sampled_from(range(len(UPCASTS))))
def test_every_norm_fuses_and_numbers_hold(kinds, dtype, hidden, eps, square, upcast):
    make = {
        "llama": lambda: LlamaStyle(hidden, eps, SQUARES[square], UPCASTS[upcast]),
        "gemma": lambda: GemmaStyle(hidden, eps),
        "functional": lambda: Functional(hidden, eps),
        "functional_no_weight": lambda: Functional(hidden, eps, weight=False),
    }
    model = Stack([make[k]() for k in kinds], hidden).to(dtype)
    x = torch.randn(2, 5, hidden, dtype=dtype)
    gm, inputs, expected, report, fused = run_pass(fuse_rmsnorm, model, x)
    assert fused == len(kinds) == count_calls(gm, FUSED) == len(report.fusions)
    assert report.misses == []
    assert count_calls(gm, torch.rsqrt) == 0 and count_calls(gm, F.rms_norm) == 0
    assert relative_error(first_output(gm, inputs), expected) <= TOLERANCE[dtype] * len(kinds)


def test_fused_node_arguments():
    model = Stack([LlamaStyle(16, eps=1e-5), GemmaStyle(16, eps=3e-6)], 16).to(torch.bfloat16)
    gm, *_ = run_pass(fuse_rmsnorm, model, torch.randn(4, 16, dtype=torch.bfloat16))
    args = [n.args[2:] for n in gm.graph.nodes if n.target == FUSED]
    assert args == [(1e-5, 0.0, torch.bfloat16), (3e-6, 1.0, torch.bfloat16)]


def test_report_records_module_source_dtype_shape():
    model = Stack([LlamaStyle(16)], 16)
    _, _, _, report, _ = run_pass(fuse_rmsnorm, model, torch.randn(3, 16))
    (record,) = report.fusions
    assert record.pattern == "rms_norm"
    assert record.module == "norms.0"
    assert record.source.startswith(__file__.rsplit("/", 1)[-1]) or "test_fuse_rmsnorm.py:" in record.source
    assert (record.dtype, record.shape) == ("float32", [3, 16])


class HalfPrecisionNorm(torch.nn.Module):  # no upcast: computing it in fp32 would change its numbers
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class WrongDimNorm(torch.nn.Module):
    def forward(self, x):
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)


class VarianceReusedNorm(torch.nn.Module):
    def forward(self, x):
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(variance + 1e-6) + variance


class OddRMSNorm(torch.nn.Module):  # eps outside the root: a different function, must never fuse
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x / (x.norm(dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + 1e-6)


class CohereLayerNorm(torch.nn.Module):  # the mean subtracted first: a LayerNorm without bias, not an RMSNorm
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        return self.weight * ((h - mean) * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("norm, dtype, reason", [
    (HalfPrecisionNorm(8), torch.bfloat16, "not upcast to float32"),
    (WrongDimNorm(), torch.float32, "not the last dimension"),
    (VarianceReusedNorm(), torch.float32, "intermediate of the norm"),
    (OddRMSNorm(8), torch.float32, "does not recognise"),
    (CohereLayerNorm(8), torch.float32, "a LayerNorm: the mean is subtracted"),
])
def test_unprovable_norms_stay_unfused_with_a_reason(norm, dtype, reason):
    model = Stack([norm.to(dtype)], 8).to(dtype)
    gm, inputs, expected, report, fused = run_pass(fuse_rmsnorm, model, torch.randn(3, 8, dtype=dtype))
    assert fused == 0 and report.fusions == [] and count_calls(gm, FUSED) == 0
    assert len(report.misses) == 1 and reason in report.misses[0].reason
    assert report.misses[0].module == "norms.0"
    torch.testing.assert_close(first_output(gm, inputs), expected, rtol=0, atol=0)
