"""graphopt::linear_cross_entropy: the op against an fp64 reference and eager F.cross_entropy (hypothesis), its
contract (opcheck, gradcheck), the proof that the [tokens × vocab] logits never exist whole, the fusion pass on
captured HF graphs (fusions and misses), and the logits policy (keep_logits)."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import graphopt
from graphopt.kernels import cross_entropy, reference
from graphopt.passes import fuse_linear_ce
from graphopt.passes.fuse_linear_ce import fuse_linear_ce as fuse
from graphs import count_calls, first_output, relative_error, run_pass
from models import COMMON, tiny_lora_model

OP = torch.ops.graphopt.linear_cross_entropy.default
IGNORE = -100


def eager_loss(hidden, weight, bias, target, ignore_index=IGNORE, reduction="mean", softcap=0.0):
    """HF's form: logits in the hidden dtype, upcast, optionally softcapped, then F.cross_entropy."""
    logits = F.linear(hidden, weight, bias).float() if hidden.dtype != torch.float64 else F.linear(hidden, weight, bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def problem(rows, width, vocab, dtype, ignored_fraction, seed, bias=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, width, generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) / width**0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < ignored_fraction] = IGNORE
    return hidden, weight, b, target


def fused_loss_and_grads(hidden, weight, bias, target, chunk_rows, reduction="mean", softcap=0.0, ignore_index=IGNORE):
    loss = OP(hidden, weight, bias, target, ignore_index, reduction, softcap, chunk_rows, True, True)[0]
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def eager_loss_and_grads(hidden, weight, bias, target, **kwargs):
    loss = eager_loss(hidden, weight, bias, target, **kwargs)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


# --- the op against fp64 --------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), width=st.sampled_from([3, 16, 64]), vocab=st.sampled_from([2, 7, 128, 1001]),
       chunk_rows=st.integers(1, 80), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       reduction=st.sampled_from(["mean", "sum"]), softcap=st.sampled_from([0.0, 1.5, 30.0]),
       ignored=st.sampled_from([0.0, 0.3, 1.0]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_fp64_reference(rows, width, vocab, chunk_rows, dtype, reduction, softcap, ignored, bias, seed):
    hidden, weight, b, target = problem(rows, width, vocab, dtype, ignored, seed, bias)
    kwargs = dict(reduction=reduction, softcap=softcap)
    fused = fused_loss_and_grads(hidden, weight, b, target, chunk_rows, **kwargs)
    eager = eager_loss_and_grads(hidden, weight, b, target, **kwargs)
    exact = eager_loss_and_grads(*(t.double().detach().requires_grad_(t.requires_grad) if t is not None else None
                                   for t in (hidden, weight, b)), target, **kwargs)
    if (target == IGNORE).all():  # no valid row: eager's NaN mean (or 0 sum) and exactly zero gradients
        for f, e in zip(fused, eager):
            torch.testing.assert_close(f, e.to(f.dtype), rtol=0, atol=0, equal_nan=True)
        return
    for f, e, x in zip(fused, eager, exact):
        if dtype == torch.float32:
            assert relative_error(f, x) <= 1e-5
        else:  # the op rounds where eager does; its error may not exceed eager's own by more than rounding noise
            assert relative_error(f, x) <= 2 * relative_error(e, x) + 2e-2


@pytest.mark.parametrize("vocab", [32001, 262144])
def test_large_and_odd_vocabularies(vocab):
    hidden, weight, _, target = problem(24, 16, vocab, torch.float32, 0.2, seed=vocab)
    fused = fused_loss_and_grads(hidden, weight, None, target, chunk_rows=5)
    eager = eager_loss_and_grads(hidden, weight, None, target)
    for f, e in zip(fused, eager):
        assert relative_error(f, e) <= 1e-5


def test_extreme_logits_stay_finite_and_exact():
    hidden, weight, _, target = problem(16, 8, 50, torch.float32, 0.0, seed=3, scale=3e3)
    fused = fused_loss_and_grads(hidden, weight, None, target, chunk_rows=4)
    eager = eager_loss_and_grads(hidden, weight, None, target)
    assert all(torch.isfinite(t).all() for t in fused)
    for f, e in zip(fused, eager):
        assert relative_error(f, e) <= 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_label_ignored_matches_eager_nan_included(reduction):
    hidden, weight, _, target = problem(9, 8, 11, torch.float32, 1.0, seed=0)
    fused = fused_loss_and_grads(hidden, weight, None, target, chunk_rows=4, reduction=reduction)
    eager = eager_loss_and_grads(hidden, weight, None, target, reduction=reduction)
    for f, e in zip(fused, eager):
        torch.testing.assert_close(f, e, rtol=0, atol=0, equal_nan=True)
    if reduction == "sum":  # HF's num_items_in_batch = 0: the gradient coming in is inf, ignored rows stay zero
        for loss_fn in (lambda: OP(hidden, weight, None, target, IGNORE, "sum", 0.0, 4, True, True)[0],
                        lambda: eager_loss(hidden, weight, None, target, reduction="sum")):
            grads = torch.autograd.grad(loss_fn() / torch.tensor(0.0), (hidden, weight))
            assert all((g == 0).all() for g in grads)


def test_ignore_index_other_than_default():
    hidden, weight, _, target = problem(20, 8, 13, torch.float32, 0.0, seed=1)
    fused = fused_loss_and_grads(hidden, weight, None, target, chunk_rows=6, ignore_index=3)
    eager = eager_loss_and_grads(hidden, weight, None, target, ignore_index=3)
    for f, e in zip(fused, eager):
        assert relative_error(f, e) <= 1e-5


def test_gradients_only_where_asked():
    hidden, weight, _, target = problem(6, 8, 10, torch.float32, 0.0, seed=2)
    loss, d_hidden, d_weight = OP(hidden, weight, None, target, IGNORE, "mean", 0.0, 4, True, False)
    assert d_hidden.shape == hidden.shape and d_weight.numel() == 0
    with pytest.raises(RuntimeError, match="without the gradient now asked for"):
        torch.autograd.grad(loss, weight)


def test_contract_errors_are_clear():
    hidden, weight, _, target = problem(6, 8, 10, torch.float32, 0.0, seed=2)
    with pytest.raises(RuntimeError, match="one label per row"):
        OP(hidden, weight, None, target[:5], IGNORE, "mean", 0.0, 4, True, True)
    with pytest.raises(RuntimeError, match="reduction 'none'"):
        OP(hidden, weight, None, target, IGNORE, "none", 0.0, 4, True, True)
    with pytest.raises(RuntimeError, match="chunk_rows=0"):
        OP(hidden, weight, None, target, IGNORE, "mean", 0.0, 0, True, True)


@pytest.mark.parametrize("softcap, bias, grads", [(0.0, False, (True, True)), (2.0, True, (True, False)),
                                                  (0.0, False, (False, False))])
def test_opcheck(softcap, bias, grads):
    hidden, weight, b, target = problem(10, 8, 12, torch.float32, 0.3, seed=4, bias=bias)
    hidden.requires_grad_(grads[0]), weight.requires_grad_(grads[1])  # as the pass decides them
    torch.library.opcheck(OP, (hidden, weight, b, target, IGNORE, "mean", softcap, 3, *grads))
    d_hidden, d_weight = torch.randn(10, 8), torch.randn(12, 8)
    torch.library.opcheck(torch.ops.graphopt.linear_cross_entropy_backward.default,
                          (torch.tensor(0.5), d_hidden, d_weight))


def test_gradcheck_fp64():
    hidden, weight, _, target = problem(7, 5, 9, torch.float64, 0.3, seed=5)
    assert torch.autograd.gradcheck(
        lambda h, w: OP(h, w, None, target, IGNORE, "mean", 2.0, 3, True, True)[0], (hidden, weight))


# --- the Triton kernel (kernels/cross_entropy.py): the interpreter on CPU, compiled on CUDA ------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPES = [torch.float32, torch.float16] + [torch.bfloat16] * (DEVICE == "cuda")  # interpreter: no bf16


def kernel_vs_fp64(rows, width, vocab, chunk_rows, dtype, reduction, softcap, ignored, bias, seed):
    hidden, weight, b, target = (t.detach().to(DEVICE) if t is not None else None
                                 for t in problem(rows, width, vocab, dtype, ignored, seed, bias))
    args = (target, IGNORE, reduction, softcap, chunk_rows, True, True)
    out = cross_entropy.linear_cross_entropy(hidden, weight, b, *args)
    same_dtype = reference.linear_cross_entropy(hidden, weight, b, *args)
    exact = reference.linear_cross_entropy(hidden.double(), weight.double(), b.double() if bias else None, *args)
    if (target == IGNORE).all():  # NaN mean or zero sum, as eager; no gradient at all
        torch.testing.assert_close(out[0], same_dtype[0], rtol=0, atol=0, equal_nan=True)
        assert all((g == 0).all() for g in out[1:])
        return
    for o, r, x in zip(out, same_dtype, exact):
        # as accurate as the reference computed in the same dtype (a 262144-term fp32 sum rounds too), up to noise
        bound = 2 * relative_error(r, x) + (1e-5 if dtype == torch.float32 else 2e-2)
        assert relative_error(o, x) <= bound


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 24), width=st.sampled_from([3, 16]), vocab=st.sampled_from([2, 7, 1001, 5000]),
       chunk_rows=st.integers(1, 30), dtype=st.sampled_from(KERNEL_DTYPES), reduction=st.sampled_from(["mean", "sum"]),
       softcap=st.sampled_from([0.0, 1.5, 30.0]), ignored=st.sampled_from([0.0, 0.3, 1.0]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_matches_fp64_reference(rows, width, vocab, chunk_rows, dtype, reduction, softcap, ignored, bias, seed):
    kernel_vs_fp64(rows, width, vocab, chunk_rows, dtype, reduction, softcap, ignored, bias, seed)


@pytest.mark.parametrize("vocab", [32001, 262144])
def test_kernel_large_and_odd_vocabularies(vocab):
    kernel_vs_fp64(6, 8, vocab, 4, torch.float32, "mean", 0.0, 0.2, False, seed=vocab)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_logits_never_exist_whole():
    """The proof of the memory claim: with chunk_rows rows per chunk, no tensor the op creates (forward and
    gradients) holds more than chunk_rows × vocab elements, where the unfused loss makes [tokens × vocab] ones."""
    rows, vocab, chunk_rows = 256, 1000, 16
    hidden, weight, _, target = problem(rows, 32, vocab, torch.float32, 0.1, seed=6)
    with LargestTensor() as fused:
        reference.linear_cross_entropy(hidden.detach(), weight.detach(), None, target, IGNORE, "mean", 30.0,
                                       chunk_rows, True, True)
    with LargestTensor() as eager:
        torch.autograd.grad(eager_loss(hidden, weight, None, target, softcap=30.0), (hidden, weight))
    assert eager.largest == rows * vocab
    assert fused.largest == max(chunk_rows * vocab, weight.numel())  # the weight gradient is [vocab × hidden]


def test_chunk_size_follows_the_byte_budget():
    vocab = 128256
    assert fuse_linear_ce.LOGITS_CHUNK_BYTES // (vocab * 4) * vocab * 4 <= fuse_linear_ce.LOGITS_CHUNK_BYTES


# --- the pass on captured graphs ------------------------------------------------------------------------------

class LMHeadLoss(torch.nn.Module):
    """HF's loss shape on a small lm_head, with knobs for the cases the pass must leave alone."""

    def __init__(self, vocab=50, width=16, upcast=True, softcap=0.0, divisor=1.0, multiplier=1.0, **loss_kwargs):
        super().__init__()
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.upcast, self.softcap, self.loss_kwargs = upcast, softcap, loss_kwargs
        self.divisor, self.multiplier = divisor, multiplier  # Granite's logits_scaling, Cohere's logit_scale

    def forward(self, hidden, labels):
        logits = self.lm_head(hidden)
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = logits.float() if self.upcast else logits
        shift = F.pad(labels, (0, 1), value=self.loss_kwargs.get("ignore_index", IGNORE))[..., 1:].contiguous()
        return F.cross_entropy(scores.view(-1, scores.shape[-1]), shift.view(-1), **self.loss_kwargs)


def hidden_and_labels(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 12, 16, generator=g).to(dtype).requires_grad_(), torch.randint(0, 50, (2, 12), generator=g)


@pytest.mark.parametrize("knobs", [{}, {"softcap": 5.0}, {"reduction": "sum"}, {"ignore_index": 0},
                                   {"divisor": 8.0}, {"multiplier": 0.0625, "softcap": 5.0}])
def test_pass_fuses_hf_loss_and_computes_the_same(knobs):
    model = LMHeadLoss(**knobs)
    gm, inputs, expected, report, fused = run_pass(fuse, model, *hidden_and_labels())
    assert fused == 1 and report.summary() == {"linear_cross_entropy": 1} and report.misses == []
    assert count_calls(gm, F.cross_entropy) == 0 and count_calls(gm, OP) == 1
    assert count_calls(gm, torch._C._nn.linear) == 0  # the logits were not a graph output here: gone
    assert count_calls(gm, torch.div) == 0  # a logit scale moves onto the hidden states, as a multiply
    assert relative_error(first_output(gm, inputs), expected) <= 1e-6


@pytest.mark.parametrize("loss_kwargs, upcast, dtype, reason", [
    ({"label_smoothing": 0.1}, True, torch.float32, "label_smoothing=0.1"),
    ({"reduction": "none"}, True, torch.float32, "reduction='none'"),
    ({"weight": torch.rand(50)}, True, torch.float32, "class weights"),
    ({}, False, torch.bfloat16, "bfloat16 logits"),
    ({"divisor": 3.0}, True, torch.float32, "scaled by 0.333333, not a power of two"),
])
def test_pass_leaves_what_it_cannot_prove_with_a_reason(loss_kwargs, upcast, dtype, reason):
    model = LMHeadLoss(upcast=upcast, **loss_kwargs).to(dtype)
    gm, inputs, expected, report, fused = run_pass(fuse, model, *hidden_and_labels(dtype))
    assert fused == 0 and count_calls(gm, F.cross_entropy) == 1
    assert len(report.misses) == 1 and reason in report.misses[0].reason
    assert report.misses[0].pattern == "linear_cross_entropy"
    torch.testing.assert_close(first_output(gm, inputs), expected, rtol=0, atol=0)


def test_pass_fuses_a_loss_on_2d_rows_without_a_view():
    def loss(hidden, weight, labels):
        return F.cross_entropy(F.linear(hidden, weight).float(), labels)

    args = (torch.randn(24, 16).requires_grad_(), torch.randn(50, 16), torch.randint(0, 50, (24,)))
    gm, inputs, expected, report, fused = run_pass(fuse, loss, *args)
    assert fused == 1 and report.misses == []
    assert relative_error(first_output(gm, inputs), expected) <= 1e-6


def test_pass_misses_a_loss_not_on_a_linear():
    def loss_of_scores(scores, labels):
        return F.cross_entropy(scores.view(-1, 50), labels.view(-1))

    scores = torch.randn(2, 12, 50, requires_grad=True)
    gm, inputs, expected, report, fused = run_pass(fuse, loss_of_scores, scores, torch.randint(0, 50, (2, 12)))
    assert fused == 0 and "not computed from a linear projection" in report.misses[0].reason


# --- through the backend: HF models, num_items_in_batch, the logits policy --------------------------------------

def train_step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()
    return out, {name: p.grad.clone() for name, p in params if p.requires_grad}


def compiled_and_eager(model, ids, options=None, **kwargs):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options=options or {})
    out, grads = train_step(compiled, ids, **kwargs)
    eager_out, eager_grads = train_step(model, ids, **kwargs)
    assert relative_error(out.loss, eager_out.loss) <= 1e-5
    for name in grads:
        assert relative_error(grads[name], eager_grads[name]) <= 1e-5, name
    return out, eager_out, graphopt.last_report()


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def test_logits_not_materialized_by_default_and_use_names_the_option():
    out, _, report = compiled_and_eager(tiny_lora_model("llama"), IDS)
    assert report.summary()["linear_cross_entropy"] == 1
    assert any("logits not materialized" in note for note in report.notes)
    assert isinstance(out.logits, graphopt.LogitsNotMaterialized) and out.logits.shape == (2, 16, 128)
    with pytest.raises(graphopt.LogitsNotMaterializedError, match="keep_logits"):
        out.logits.argmax(-1)


def test_keep_logits_returns_hf_logits():
    out, eager_out, report = compiled_and_eager(tiny_lora_model("llama"), IDS, {"keep_logits": True})
    assert report.summary()["linear_cross_entropy"] == 1 and not any("logits" in note for note in report.notes)
    assert relative_error(out.logits, eager_out.logits) <= 1e-5


def test_gradient_accumulation_form_num_items_in_batch():
    compiled_and_eager(tiny_lora_model("qwen2"), IDS, num_items_in_batch=torch.tensor(7))
    assert graphopt.last_report().summary()["linear_cross_entropy"] == 1


def test_gemma2_final_logit_softcapping():
    import peft

    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       final_logit_softcapping=3.0)
    model = peft.get_peft_model(transformers.Gemma2ForCausalLM(config),
                                peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    _, _, report = compiled_and_eager(model, IDS)
    assert report.summary()["linear_cross_entropy"] == 1
    assert [r.module for r in report.fusions if r.pattern == "linear_cross_entropy"] == ["base_model.model.lm_head"]


ONE_LAYER = {**COMMON, "num_hidden_layers": 1}


@pytest.mark.parametrize("config", [
    transformers.GraniteConfig(logits_scaling=8.0, **ONE_LAYER),  # logits / 8
    transformers.CohereConfig(logit_scale=0.0625, **ONE_LAYER),  # logits · 1/16
], ids=["granite", "cohere"])
def test_a_power_of_two_logit_scale_fuses_and_trains_as_eager(config):
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    _, _, report = compiled_and_eager(model, IDS)
    assert report.summary()["linear_cross_entropy"] == 1


def test_evaluation_keeps_logits_and_says_why():
    model = tiny_lora_model("mistral")
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="graphopt")(input_ids=IDS, labels=IDS)
        eager = model(input_ids=IDS, labels=IDS)
    report = graphopt.last_report()
    assert "linear_cross_entropy" not in report.summary()
    assert ["evaluation" in m.reason for m in report.misses if m.pattern == "linear_cross_entropy"] == [True]
    assert relative_error(out.logits, eager.logits) <= 1e-5 and relative_error(out.loss, eager.loss) <= 1e-5
