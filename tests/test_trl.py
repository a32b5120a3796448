"""TRL's chunked log-prob head (trl/kernels/chunked_logprob.py) as graphopt::linear_logprobs: the op against an fp64
computation and against TRL's own Function (hypothesis), its contract (opcheck, gradcheck, errors), the logits never
whole, the Triton kernels under the interpreter, the pass on the graph Dynamo hands over (fusion, misses), and
TRL's SFT (padded and packed), DPO, KTO, GRPO and RLOO trainers on a model compiled by graphopt against the same
trainers uncompiled."""

import json
from pathlib import Path

import datasets
import pytest
import tokenizers
import torch
import transformers
import trl
from hypothesis import given, settings, strategies as st
from tokenizers import decoders, models, pre_tokenizers
from torch.utils.flop_counter import FlopCounterMode
from transformers.convert_slow_tokenizer import bytes_to_unicode
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

import graphopt
from graphopt.kernels import linear_logprobs as kernel, reference
from graphopt.passes import fuse_trl_logprob, recompute  # noqa: F401  (recompute: the ops' FLOP formulas)
from graphopt.passes.fuse_trl_logprob import fuse_trl_logprob as fuse
from graphopt.passes.normalize import normalize
from graphopt.plan import Plan
from graphs import capture, count_calls, relative_error
from models import tiny_lora_model
from test_linear_ce import IGNORE, LargestTensor
from test_linear_ce import problem as lm_head_problem
from test_trainer import DEVICES, PRECISIONS
from texts import VOCAB, sentences

OP = torch.ops.graphopt.linear_logprobs.default
BACKWARD = torch.ops.graphopt.linear_logprobs_backward.default
OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def problem(rows, width, vocab, dtype, seed, bias=False, ignored=0.0, scale=1.0):
    """hidden, weight, bias, labels (IGNORE where a position has no label): the fused loss's test problem."""
    return lm_head_problem(rows, width, vocab, dtype, ignored, seed, bias, scale)


def fp64_logits(hidden, weight, bias, temperature, softcap, logit_scale):
    z = hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())
    z = z * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def near_tie(hidden, weight, bias, targets, temperature, softcap, logit_scale):
    """Rows whose target logit and best other logit are within rounding of each other (in fp64): there is_top1 may
    differ between dtypes."""
    z = fp64_logits(hidden, weight, bias, temperature, softcap, logit_scale).detach()
    gap = z.gather(1, targets[:, None]).squeeze(1) - z.scatter(1, targets[:, None], -torch.inf).amax(-1)
    return gap.abs() <= 1e-2 * z.abs().amax(-1)


def fp64_head(hidden, weight, bias, targets, temperature, softcap, logit_scale):
    """The statistics from the whole [rows, vocab] logits in fp64 (shares no code with graphopt or TRL)."""
    z = fp64_logits(hidden, weight, bias, temperature, softcap, logit_scale)
    log_p = torch.log_softmax(z, dim=-1)
    return dict(log_probs=log_p.gather(1, targets[:, None]).squeeze(1), entropy=-(log_p.exp() * log_p).sum(-1),
                log_sum_sq_probs=torch.logsumexp(2 * log_p, dim=-1), mean_logits=z.mean(-1),
                is_top1=z.argmax(-1) == targets)


def graphopt_head(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs, chunk_rows=7,
                  compute_dtype=None):
    out = OP(hidden, weight, bias, targets, temperature, softcap, logit_scale, compute_dtype or hidden.dtype,
             *(name in outputs for name in OPTIONAL), chunk_rows)
    return dict(zip(("log_probs", *OPTIONAL), out))


def trl_head(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    out = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, 32768, softcap or None, logit_scale,
                                       tuple(outputs))
    return dict(zip(("log_probs", *OPTIONAL), out))


def masked_loss_and_grads(head, hidden, weight, mask, outputs):
    """TRL's use: positions without a label are scored with label 0, then zeroed; an SFT-style loss, plus an entropy
    bonus when the entropy is computed (its gradient too). (stats, d hidden, d weight)."""
    stats = {name: t.masked_fill(~mask, 0) for name, t in head.items() if t is not None and t.numel()}
    loss = -stats["log_probs"].sum() / mask.sum().clamp(min=1)
    if "entropy" in outputs:
        loss = loss + 0.1 * stats["entropy"].sum()
    return (stats, *torch.autograd.grad(loss, (hidden, weight)))


# --- the op against fp64 and against TRL's Function --------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), width=st.sampled_from([3, 16]), vocab=st.sampled_from([2, 7, 130, 1001]),
       chunk_rows=st.integers(1, 45), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       temperature=st.sampled_from([1.0, 0.7, 2.5]), softcap=st.sampled_from([0.0, 1.5, 30.0]),
       logit_scale=st.sampled_from([1.0, 0.25, 3.0]), outputs=st.sets(st.sampled_from(OPTIONAL)),
       bias=st.booleans(), ignored=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_matches_fp64_and_trl(rows, width, vocab, chunk_rows, dtype, temperature, softcap, logit_scale, outputs,
                              bias, ignored, seed):
    hidden, weight, b, labels = problem(rows, width, vocab, dtype, seed, bias, ignored)
    mask, targets = labels != IGNORE, labels.clamp(min=0)
    config = (targets, temperature, softcap, logit_scale)
    ours = masked_loss_and_grads(graphopt_head(hidden, weight, b, *config, outputs, chunk_rows), hidden, weight,
                                 mask, outputs)
    theirs = masked_loss_and_grads(trl_head(hidden, weight, b, *config, outputs), hidden, weight, mask, outputs)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    exact = masked_loss_and_grads(fp64_head(h64, w64, b, *config), h64, w64, mask, outputs)
    assert set(ours[0]) == {"log_probs", *outputs}
    for name in set(ours[0]) - {"is_top1"}:
        pairs = [(ours[0][name], theirs[0][name], exact[0][name])]
        if name == "log_probs":
            pairs += list(zip(ours[1:], theirs[1:], exact[1:]))
        for o, t, x in pairs:
            if dtype == torch.float32:
                assert relative_error(o, x) <= 1e-5, name
            else:  # rounded where TRL rounds: no further from fp64 than TRL, up to rounding noise
                assert relative_error(o, x) <= 2 * relative_error(t, x) + 1e-2, name
            assert relative_error(o, t) <= (1e-5 if dtype == torch.float32 else 1e-2), name
    if "is_top1" in outputs:  # TRL's value; fp64's except where the two best logits tie within rounding
        assert torch.equal(ours[0]["is_top1"], theirs[0]["is_top1"])
        tie = near_tie(h64, w64, b, *config)
        assert ((ours[0]["is_top1"] == exact[0]["is_top1"]) | tie).all()


def test_extreme_logits_stay_finite():
    hidden, weight, _, labels = problem(16, 8, 50, torch.float32, seed=3, scale=3e3)
    head = graphopt_head(hidden, weight, None, labels, 1.0, 0.0, 1.0, OPTIONAL)
    exact = fp64_head(hidden, weight, None, labels, 1.0, 0.0, 1.0)
    assert all(torch.isfinite(t.float()).all() for t in head.values())
    for name in ("log_probs", "entropy", "mean_logits"):
        assert relative_error(head[name], exact[name]) <= 1e-5
    grads = torch.autograd.grad(head["log_probs"].sum(), (hidden, weight))
    assert all(torch.isfinite(g).all() for g in grads)


def test_autocast_dtype_computes_as_trl_under_autocast():
    """compute_dtype bf16 on fp32 inputs is what TRL computes under bf16 autocast: gradients in fp32."""
    hidden, weight, _, labels = problem(20, 16, 130, torch.float32, seed=4)
    ours = graphopt_head(hidden, weight, None, labels, 0.8, 0.0, 1.0, OPTIONAL, compute_dtype=torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):
        theirs = trl_head(hidden, weight, None, labels, 0.8, 0.0, 1.0, OPTIONAL)
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert relative_error(ours[name], theirs[name]) <= 1e-5, name
    grads = [torch.autograd.grad(h["log_probs"].sum() + h["entropy"].sum(), (hidden, weight)) for h in (ours, theirs)]
    for o, t in zip(*grads):
        assert o.dtype == t.dtype == torch.float32 and relative_error(o, t) <= 1e-5


def test_gradients_only_where_asked_and_frozen_bias():
    hidden, weight, b, labels = problem(6, 8, 10, torch.float32, seed=2, bias=True)
    weight.requires_grad_(False)
    head = graphopt_head(hidden, weight, b, labels, 1.0, 0.0, 1.0, ())
    (d_hidden,) = torch.autograd.grad(head["log_probs"].sum(), hidden)
    assert d_hidden.shape == hidden.shape
    b.requires_grad_()
    head = graphopt_head(hidden, weight, b, labels, 1.0, 0.0, 1.0, ())
    with pytest.raises(RuntimeError, match="no gradient for the lm_head bias"):
        torch.autograd.grad(head["log_probs"].sum(), b)


def test_contract_errors_are_clear():
    hidden, weight, _, labels = problem(6, 8, 10, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="one label per row"):
        graphopt_head(hidden, weight, None, labels[:5], 1.0, 0.0, 1.0, ())
    with pytest.raises(RuntimeError, match="temperature=0.0 must be > 0"):
        graphopt_head(hidden, weight, None, labels, 0.0, 0.0, 1.0, ())
    with pytest.raises(RuntimeError, match="chunk_rows=0"):
        graphopt_head(hidden, weight, None, labels, 1.0, 0.0, 1.0, (), chunk_rows=0)
    with pytest.raises(RuntimeError, match="outside"):
        graphopt_head(hidden, weight, None, labels.clamp(max=-1), 1.0, 0.0, 1.0, ())


@pytest.mark.parametrize("dtype, compute_dtype, outputs, softcap, bias, grads", [
    (torch.float32, torch.float32, OPTIONAL, 30.0, True, (True, True)),
    (torch.float32, torch.bfloat16, ("entropy",), 0.0, False, (True, False)),
    (torch.bfloat16, torch.bfloat16, ("is_top1", "mean_logits"), 0.0, False, (False, False)),
])
def test_opcheck(dtype, compute_dtype, outputs, softcap, bias, grads):
    hidden, weight, b, labels = problem(10, 8, 12, dtype, seed=4, bias=bias)
    hidden.requires_grad_(grads[0]), weight.requires_grad_(grads[1])
    flags = [name in outputs for name in OPTIONAL]
    torch.library.opcheck(OP, (hidden, weight, b, labels, 0.7, softcap, 1.5, compute_dtype, *flags, 3))
    stats = reference.linear_logprobs(hidden.detach(), weight.detach(), b, labels, 0.7, softcap, 1.5, compute_dtype,
                                      *flags, 3)
    entropy = stats[1]
    grad_entropy = torch.randn(entropy.shape)  # empty when the entropy was not computed
    torch.library.opcheck(BACKWARD, (torch.randn(10), grad_entropy, hidden.detach(), weight.detach(), b, labels,
                                     stats[5], entropy, 0.7, softcap, 1.5, compute_dtype, 3, True, True))


def test_gradcheck_fp64():
    hidden, weight, _, labels = problem(7, 5, 9, torch.float64, seed=5)
    g = torch.Generator().manual_seed(6)
    weights = torch.randn(7, dtype=torch.float64, generator=g), torch.randn(7, dtype=torch.float64, generator=g)

    def loss(h, w):
        head = graphopt_head(h, w, None, labels, 0.7, 2.0, 1.3, ("entropy",), chunk_rows=3)
        return (head["log_probs"] * weights[0]).sum() + (head["entropy"] * weights[1]).sum()

    assert torch.autograd.gradcheck(loss, (hidden, weight))


def test_logits_never_exist_whole():
    """No tensor the op creates, forward or backward, holds more than chunk_rows × vocab elements (the weight's
    gradient aside), where TRL's tiles are [4096 × 32768] and eager logits [rows × vocab]."""
    rows, vocab, chunk_rows = 256, 1000, 16
    hidden, weight, _, labels = problem(rows, 32, vocab, torch.float32, seed=6)
    with LargestTensor() as fused:
        head = graphopt_head(hidden, weight, None, labels, 1.0, 30.0, 1.0, OPTIONAL, chunk_rows=chunk_rows)
        torch.autograd.grad(head["log_probs"].sum() + head["entropy"].sum(), (hidden, weight))
    assert fused.largest == max(chunk_rows * vocab, weight.numel())


def test_flop_formulas_price_the_matmuls():
    """passes/recompute.py prices the op by its lm_head matmul, so the partitioner's knapsack keeps its [tokens]
    outputs rather than recompute it; the backward counts the logits again and each gradient it computes."""
    rows, vocab, width = 10, 20, 8
    hidden, weight, _, labels = problem(rows, width, vocab, torch.float32, seed=1)
    with FlopCounterMode(display=False) as counter:
        head = graphopt_head(hidden, weight, None, labels, 1.0, 0.0, 1.0, ("entropy",))
        torch.autograd.grad(head["log_probs"].sum(), (hidden, weight))
    matmul = 2 * rows * vocab * width
    assert counter.get_flop_counts()["Global"] == {OP.overloadpacket: matmul, BACKWARD.overloadpacket: 3 * matmul}


# --- the Triton kernels (kernels/linear_logprobs.py): the interpreter on CPU, compiled on CUDA -----------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPES = [torch.float32, torch.float16] + [torch.bfloat16] * (DEVICE == "cuda")  # interpreter: no bf16


def kernel_vs_reference(rows, vocab, chunk_rows, dtype, temperature, softcap, logit_scale, outputs, bias, seed):
    hidden, weight, b, labels = (t.detach().to(DEVICE) if t is not None else None
                                 for t in problem(rows, 16, vocab, dtype, seed, bias))
    flags = [name in outputs for name in OPTIONAL]
    args = (labels, temperature, softcap, logit_scale, dtype, *flags, chunk_rows)
    got = kernel.linear_logprobs(hidden, weight, b, *args)
    same_dtype = reference.linear_logprobs(hidden, weight, b, *args)
    exact = reference.linear_logprobs(hidden.double(), weight.double(), None if b is None else b.double(),
                                      *args[:4], torch.float64, *args[5:])
    for name, g, r, x in zip(("log_probs", *OPTIONAL, "log_z"), got, same_dtype, exact):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        if not g.numel():
            continue
        if name == "is_top1":
            assert ((g == x) | near_tie(hidden, weight, b, labels, temperature, softcap, logit_scale)).all()
        else:
            assert relative_error(g, x) <= 2 * relative_error(r, x) + 1e-5, name
    g = torch.Generator().manual_seed(seed)
    grad_log_probs = torch.randn(rows, generator=g).to(DEVICE)
    grad_entropy = torch.randn(rows, generator=g).to(DEVICE) if "entropy" in outputs else grad_log_probs[:0]
    head_config = (temperature, softcap, logit_scale)
    backward = (grad_log_probs, grad_entropy, hidden, weight, b, labels, same_dtype[5], same_dtype[1], *head_config,
                dtype, chunk_rows, True, True)
    got = kernel.linear_logprobs_backward(*backward)
    same = reference.linear_logprobs_backward(*backward)
    exact = reference.linear_logprobs_backward(grad_log_probs, grad_entropy, hidden.double(), weight.double(),
                                               None if b is None else b.double(), labels, exact[5], exact[1],
                                               *head_config, torch.float64, chunk_rows, True, True)
    for g, r, x in zip(got, same, exact):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert relative_error(g, x) <= 2 * relative_error(r, x) + (1e-5 if dtype == torch.float32 else 2e-3)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.sampled_from([2, 7, 130, 1001]), chunk_rows=st.integers(1, 45),
       dtype=st.sampled_from(KERNEL_DTYPES), temperature=st.sampled_from([1.0, 0.7]),
       softcap=st.sampled_from([0.0, 30.0]), logit_scale=st.sampled_from([1.0, 0.25]),
       outputs=st.sets(st.sampled_from(OPTIONAL)), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_kernels_match_the_reference(rows, vocab, chunk_rows, dtype, temperature, softcap, logit_scale, outputs,
                                     bias, seed):
    kernel_vs_reference(rows, vocab, chunk_rows, dtype, temperature, softcap, logit_scale, outputs, bias, seed)


def test_kernels_loop_over_column_blocks():
    """A vocabulary wider than one block: one row per program, the online statistics carried across blocks."""
    kernel_vs_reference(5, 9000, 3, torch.float32, 0.7, 30.0, 1.5, OPTIONAL, True, seed=7)


# --- the pass on the graph Dynamo hands over -----------------------------------------------------------------------

def head_loss(hidden, weight, labels, bias=None, temperature=1.0, softcap=None, logit_scale=1.0,
              outputs=("entropy", "is_top1")):
    """TRL's patched forward (trl/trainer/utils.py add_fused_lm_head) on the CPU, after the backbone: the SFT loss,
    and the entropy and top-1 count it logs."""
    mask = labels != IGNORE
    per_token = ChunkedLogProbFunction.apply(hidden, weight, bias, labels.clamp(min=0), temperature, 32768, softcap,
                                             logit_scale, outputs)
    log_probs = per_token[0].masked_fill(~mask, 0)
    loss = -log_probs.sum() / mask.sum().clamp(min=1)
    return loss + 0.1 * per_token[1].masked_fill(~mask, 0).sum(), per_token[4].masked_fill(~mask, 0).sum()


HEAD_CALL_LINE = next(number for number, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                      if "per_token = ChunkedLogProbFunction.apply(" in line)


def captured_and_fused(fn, *args):
    gm, inputs = capture(fn, *args)
    expected = gm(*inputs)
    normalize(gm)
    report = Plan(graph=0)
    return gm, inputs, expected, report, fuse(gm, report)


def loss_and_grads(fn, args, leaves):
    loss, top1 = fn(*args)[:2]
    return (loss, top1, *torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("config", [dict(), dict(temperature=0.7, softcap=5.0, logit_scale=1.3),
                                    dict(outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))])
def test_pass_fuses_trl_head_and_computes_the_same(config):
    hidden, weight, _, labels = problem(24, 16, 130, torch.float32, seed=8, ignored=0.3)
    fn = lambda h, w, y: head_loss(h, w, y, **config)  # noqa: E731
    gm, inputs, expected, report, fused = captured_and_fused(fn, hidden, weight, labels)
    assert fused == 1 and report.summary() == {"trl_logprobs": 1} and report.misses == []
    assert count_calls(gm, OP) == 1 and not any(fuse_trl_logprob.trl_function(n) for n in gm.graph.nodes)
    record = report.fusions[0]
    assert (record.dtype, record.shape) == ("float32", [24, 130])  # the logits never made
    assert record.source.endswith(f"test_trl.py:{HEAD_CALL_LINE}")
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    got, eager = loss_and_grads(gm, inputs, leaves), loss_and_grads(fn, (hidden, weight, labels), (hidden, weight))
    assert relative_error(got[0], expected[0]) <= 1e-6 and torch.equal(got[1], expected[1])
    for g, e in zip(got, eager):
        assert relative_error(g, e) <= 1e-5


def test_pass_reads_the_autocast_dtype():
    """Under bf16 autocast (the forward only, as HF's Trainer) the projection runs in bf16, as TRL's does."""
    hidden, weight, _, labels = problem(24, 16, 130, torch.float32, seed=9)
    with torch.autocast("cpu", torch.bfloat16):
        gm, inputs, expected, report, fused = captured_and_fused(head_loss, hidden, weight, labels)
        got, eager = gm(*inputs), head_loss(hidden, weight, labels)
    (op,) = [n for n in gm.graph.nodes if n.target is OP]
    assert fused == 1 and op.args[7] == torch.bfloat16 and report.fusions[0].dtype == "bfloat16"
    assert relative_error(got[0], eager[0]) <= 1e-5 and torch.equal(got[1], eager[1])
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    for g, e in zip(torch.autograd.grad(got[0], leaves), torch.autograd.grad(eager[0], (hidden, weight))):
        assert g.dtype == e.dtype == torch.float32 and relative_error(g, e) <= 1e-5


@pytest.mark.parametrize("config, reason", [
    (dict(bias=True), "the lm_head bias trains"),
    (dict(softcap=0.0), "final_logit_softcapping 0.0"),
    (dict(outputs=("entropy", "is_top1", "logits")), "outputs ('entropy', 'is_top1', 'logits')"),
])
def test_pass_leaves_what_it_cannot_prove_with_a_reason(config, reason):
    hidden, weight, _, labels = problem(12, 8, 40, torch.float32, seed=10)
    bias = torch.zeros(40, requires_grad=True) if config.pop("bias", False) else None
    fn = lambda h, w, y: head_loss(h, w, y, bias=bias, **config)  # noqa: E731
    gm, inputs, expected, report, fused = captured_and_fused(fn, hidden, weight, labels)
    assert fused == 0 and count_calls(gm, OP) == 0
    assert [(m.pattern, reason in m.reason) for m in report.misses] == [("trl_logprobs", True)]
    got = gm(*inputs)  # TRL's call stays, and runs TRL's code
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_fusions_option_turns_it_off_and_trl_code_is_traced():
    """Unfused, aot_autograd traces TRL's own torch path: the same numbers, no fusion, no miss."""
    hidden, weight, _, labels = problem(24, 16, 130, torch.float32, seed=12, ignored=0.3)
    torch._dynamo.reset()
    compiled = torch.compile(head_loss, backend="graphopt", options={"fusions": {"trl_logprobs": False}})
    got = loss_and_grads(compiled, (hidden, weight, labels), (hidden, weight))
    report = graphopt.last_report()
    assert "trl_logprobs" not in report.summary() and report.misses == []
    for g, e in zip(got, loss_and_grads(head_loss, (hidden, weight, labels), (hidden, weight))):
        assert relative_error(g, e) <= 1e-5


def test_other_trl_releases_are_not_exposed_and_say_so(monkeypatch):
    # TRL's own forward, as an unexposed release has it; both methods get graphopt's wrappers back after the test
    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(ChunkedLogProbFunction.forward.graphopt_wraps))
    monkeypatch.setattr(ChunkedLogProbFunction, "backward", ChunkedLogProbFunction.__dict__["backward"])
    monkeypatch.setattr(fuse_trl_logprob, "_trl_version", lambda: "1.15.0")
    reason = fuse_trl_logprob.expose_trl_head()
    assert reason.startswith("TRL 1.15.0's head is not shown to Dynamo") and "1.16" in reason
    assert ChunkedLogProbFunction.forward._torchdynamo_disable  # its frames run as TRL wrote them
    # a graph TRL's patched forward contributed to says why its head is not there (this process exposed TRL 1.16's
    # before the test, so here the head is in the graph too)
    model = tiny_lora_model("llama", vocab_size=VOCAB, num_hidden_layers=1)
    trl.trainer.utils.add_fused_lm_head(model.get_base_model())
    ids = torch.randint(0, VOCAB, (2, 8))
    gm, _ = capture(lambda i: model(input_ids=i, labels=i, fused_lm_head=True).loss, ids)
    monkeypatch.setattr(fuse_trl_logprob, "NOT_EXPOSED", reason)
    report = Plan(graph=0)
    fuse(gm, report)
    (miss,) = [m for m in report.misses if m.reason == reason]
    assert miss.pattern == "trl_logprobs" and miss.source.startswith("trl/trainer/utils.py")


def test_an_unexposed_head_is_found_where_trl_is_installed_outside_site_packages(monkeypatch):
    """TRL on PYTHONPATH (`pip install --target DIR`): the report keeps the frame's whole path, and the graph TRL's
    forward contributed to still says why the head is not in it."""
    monkeypatch.setattr(fuse_trl_logprob, "NOT_EXPOSED", "TRL 1.15.0's head is not shown to Dynamo")
    gm = torch.fx.symbolic_trace(lambda mask, x: x.new_zeros(mask.shape).masked_scatter(mask, x))
    for node in gm.graph.nodes:  # what Dynamo records for the masked_scatter after TRL's head
        node.meta["stack_trace"] = ('  File "/work/run/.site/trl/trainer/utils.py", line 1652, in <genexpr>\n'
                                    '    None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)\n')
    report = Plan(graph=0)
    fuse(gm, report)
    (miss,) = report.misses
    assert miss.pattern == "trl_logprobs" and miss.source == "/work/run/.site/trl/trainer/utils.py:1652"


# --- TRL's trainers on a model compiled by graphopt ----------------------------------------------------------------

PREFERENCES = Path(__file__).parent / "data" / "preferences.json"  # prompt / chosen / rejected triples
# DEVICES: on the GPU every trainer runs again with the Triton lowering (and CUDA graphs where the shapes are static)


def preferences():
    """The preference set's rows: prompt, chosen, rejected."""
    return json.loads(PREFERENCES.read_text())


def demo_texts(count):
    """The first `count` sentences of the demo text, as an SFT dataset."""
    return datasets.Dataset.from_list([{"text": bytes(row["input_ids"]).decode()} for row in sentences()[:count]])


def byte_tokenizer():
    """A tokenizer over the 256 byte values (token id = byte), built here (no download): GPT-2's byte-level
    pre-tokenizer and a BPE model without merges. Byte 0 pads, byte 3 (end of text) ends a sequence."""
    symbol = bytes_to_unicode()
    byte_level = tokenizers.Tokenizer(models.BPE(vocab={symbol[b]: b for b in range(256)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_level.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level, pad_token=symbol[0], eos_token=symbol[3])


def test_byte_tokenizer_maps_bytes_to_ids():
    tokenizer = byte_tokenizer()
    text = "Hello, wörld!"
    ids = tokenizer(text + tokenizer.eos_token)["input_ids"]
    assert ids == [*text.encode(), 3] and tokenizer.pad_token_id == 0 and len(tokenizer) == VOCAB
    assert tokenizer.decode(ids[:-1]) == text


def train(trainer_cls, config_cls, data, tmp_path, compiled, bf16, layers, config=None, trainer=None, device="cpu"):
    """(log history, final adapters, reports compiled) of two optimizer steps of a TRL trainer; config and trainer:
    more arguments of the config and of the trainer."""
    model = tiny_lora_model("llama", vocab_size=VOCAB, num_hidden_layers=layers)
    torch._dynamo.reset()
    before = len(graphopt.reports())
    if compiled:
        model.compile(backend="graphopt")  # in place, before the trainer patches the forward with TRL's head
    # TRL turns HF's gradient checkpointing on by default: with PEFT its input hook (requires_grad_ on the
    # embeddings' output) breaks Dynamo's graph ahead of the backbone; off, each forward is one graph
    args = config_cls(str(tmp_path / ("compiled" if compiled else "eager")), use_cpu=device == "cpu", bf16=bf16, seed=0,
                      data_seed=0, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
                      learning_rate=2e-3, max_grad_norm=1.0, logging_steps=1, report_to=[], disable_tqdm=True,
                      gradient_checkpointing=False, **(config or {}))
    trained = trainer_cls(model=model, args=args, train_dataset=data, processing_class=byte_tokenizer(),
                          **(trainer or {}))
    trained.train()
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trained.state.log_history, adapters, graphopt.reports()[before:]


def logged(history, key):
    return [entry[key] for entry in history if key in entry]


def assert_same_training(eager, compiled, keys, bf16, device="cpu"):
    """The compiled run's logged keys and final adapters equal the eager run's; TRL's head fused wherever it was
    compiled. Returns the reports of the graphs that hold the backbone."""
    (eager_history, eager_adapters, _), (history, adapters, reports) = eager, compiled
    close = dict(rel=5e-2, abs=1e-2) if bf16 else dict(rel=1e-5)  # Liger's convergence tolerances in bf16
    for key in keys:
        assert len(logged(history, key)) == len(logged(eager_history, key)) == 2, key
        assert logged(history, key) == pytest.approx(logged(eager_history, key), **close), key
    for name, weight in adapters.items():
        assert relative_error(weight, eager_adapters[name]) <= (5e-2 if bf16 else 1e-5), name
    assert all(m.pattern != "trl_logprobs" for report in reports for m in report.misses)
    if device == "cpu":
        assert reports and all(report.summary().get("trl_logprobs") == 1 for report in reports)
        return reports
    # on Triton devices TRL's forward keeps only the labelled positions (hidden_states[mask]): a shape known only
    # from the data, where Dynamo breaks the graph, so the head is a graph of its own after each backbone's
    heads = [report for report in reports if "trl_logprobs" in report.summary()]
    assert heads and all(report.summary() == {"trl_logprobs": 1} for report in heads)
    return [report for report in reports if report not in heads]


@pytest.mark.parametrize("bf16, device", PRECISIONS)
def test_sft_trainer_matches_the_uncompiled_trainer(tmp_path, bf16, device):
    """SFT on the demo text: batches padded to their own length (the first compiles static, the next dynamic),
    gradient accumulation 2; per-step loss, grad_norm, entropy and token accuracy (TRL's head computes the last
    two), and the final adapters."""
    data = demo_texts(16)
    runs = [train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path, compiled, bf16, layers=1, device=device)
            for compiled in (0, 1)]
    keys = ("loss", "grad_norm", "entropy") + (() if bf16 else ("mean_token_accuracy",))  # bf16: near ties flip
    reports = assert_same_training(*runs, keys, bf16, device)
    assert len(reports) == 2 and all(report.summary()["lora"] == 7 for report in reports)


@pytest.mark.parametrize("device", DEVICES)
def test_sft_trainer_with_packing_matches_the_uncompiled_trainer(tmp_path, device):
    """SFTConfig(packing=True): documents packed into rows of max_length, padding-free (position_ids restart per
    document), so attention is graphopt::packed_attention; loss, grad_norm and adapters as uncompiled, fp32."""
    data = demo_texts(32)
    runs = [train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path, compiled, False, layers=1,
                  config=dict(packing=True, max_length=128), device=device) for compiled in (0, 1)]
    reports = assert_same_training(*runs, ("loss", "grad_norm"), False, device)
    assert all(report.summary().get("attention_packed") == 1 for report in reports)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16=True"])
def test_dpo_trainer_matches_the_uncompiled_trainer(tmp_path, bf16, device):
    """DPO on tests/data/preferences.json: the policy's forward and the reference's (adapters off, no gradients)
    each compile static, then dynamic. One decoder layer: four compiles are the test's time. On CUDA in bf16 the
    first step's backward records CUDA graphs around the padded attention's backward and the adapters' gradient
    copies (lowering/cuda.py: extracted_outputs_beside_their_kernel)."""
    data = datasets.Dataset.from_list(preferences())
    runs = [train(trl.DPOTrainer, trl.DPOConfig, data, tmp_path, compiled, bf16, layers=1, device=device)
            for compiled in (0, 1)]
    reports = assert_same_training(*runs, ("loss", "grad_norm", "logps/chosen", "logps/rejected"), bf16, device)
    assert len(reports) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_dpo_with_batches_padded_to_one_length_keeps_cuda_graphs_in_bf16(tmp_path):
    """pad_to_multiple_of=128 pads every batch of the preference set to one length: the policy's graph stays static
    and replays as CUDA graphs every step, the reference's forward between its forward and backward."""
    data = datasets.Dataset.from_list(preferences())
    runs = [train(trl.DPOTrainer, trl.DPOConfig, data, tmp_path, compiled, True, layers=1, device="cuda",
                  config=dict(pad_to_multiple_of=128)) for compiled in (0, 1)]
    reports = assert_same_training(*runs, ("loss", "grad_norm", "logps/chosen", "logps/rejected"), True, "cuda")
    training = [report for report in reports if "no backward" not in report.cuda_graphs["why"]]
    assert training and all(report.cuda_graphs["on"] for report in training)


@pytest.mark.parametrize("device", DEVICES)
def test_kto_trainer_matches_the_uncompiled_trainer(tmp_path, device):
    """KTO on the preference set unpaired: the policy's forward, the KL forward on mismatched pairs (no gradients)
    and the reference's through the frozen "ref" adapter TRL adds beside the trained one. The second step's rewards
    differ from zero only through that adapter: equal to eager, the compiled model followed PEFT's adapter switch."""
    data = datasets.Dataset.from_list([{"prompt": row["prompt"], "completion": row[kind], "label": kind == "chosen"}
                                       for row in preferences() for kind in ("chosen", "rejected")])
    runs = [train(trl.KTOTrainer, trl.KTOConfig, data, tmp_path, compiled, False, layers=1, device=device)
            for compiled in (0, 1)]
    assert_same_training(*runs, ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/chosen"), False,
                         device)
    assert logged(runs[1][0], "rewards/chosen")[1] != 0


@pytest.mark.parametrize("trainer_cls, config_cls, keys", [
    (trl.GRPOTrainer, trl.GRPOConfig, ("loss", "grad_norm", "reward")),
    (trl.RLOOTrainer, trl.RLOOConfig, ("grad_norm", "reward"))], ids=["GRPO", "RLOO"])
@pytest.mark.parametrize("device", DEVICES)
def test_online_trainers_match_the_uncompiled_trainer(tmp_path, trainer_cls, config_cls, keys, device):
    """GRPO and RLOO on the preference set's prompts, rewarded by completion length: completions are sampled
    through `generate` (eager, the same draws in both runs), their log-probs through the compiled forward. RLOO's
    advantages sum to zero over a prompt's completions: its logged loss is zero up to rounding (so not compared)
    and some gradient components are at rounding level, which AdamW would scale to full-size steps (adapters 2e-5
    apart); SGD keeps the comparison at fp32's tolerance."""
    data = datasets.Dataset.from_list([{"prompt": row["prompt"]} for row in preferences()])
    runs = [train(trainer_cls, config_cls, data, tmp_path, compiled, False, layers=1,
                  config=dict(num_generations=4, max_completion_length=8, optim="sgd"),
                  trainer=dict(reward_funcs=lambda completions, **_: [float(len(c)) for c in completions]),
                  device=device) for compiled in (0, 1)]
    assert_same_training(*runs, keys, False, device)
