"""graphopt::rope: the Triton kernel and the op against HF's own formula in fp64, opcheck, gradcheck, and the fusion
pass on Dynamo graphs of tiny HF models (one fusion per attention layer, numbers unchanged) and on the forms it
must leave unfused with a reason.

cos/sin are drawn at random, not as HF's duplicated halves, so a backward that only holds for HF's cos/sin (the
forward with sin negated) would fail here. The kernel runs on DEVICE: compiled on CUDA, else through the Triton
interpreter, which computes bf16 wrong, so bf16 is checked on CUDA only.
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphopt  # noqa: F401  (registers the graphopt ops)
from graphopt.kernels import reference
from graphopt.kernels import rope as kernels
from graphopt.passes.fuse_rope import fuse_rope
from graphs import count_calls, first_output, relative_error, run_pass
from models import tiny_lora_model
from test_kernel_rmsnorm import DEVICE, DTYPES, TOL

OP = torch.ops.graphopt.rope.default
BACKWARD = torch.ops.graphopt.rope_backward.default


def rotate_half(x):  # HF's, verbatim
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):
    """HF's apply_rotary_pos_emb as Phi-3 writes it, verbatim (partial rotary; with R = D the result is Llama's)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def exact(q, k, cos, sin, grad_q, grad_k):
    """HF's formula in fp64, its backward by autograd: independent of kernels/reference.py."""
    q, k = (t.detach().double().requires_grad_() for t in (q, k))
    q_out, k_out = hf_rope(q, k, cos.double(), sin.double())
    torch.autograd.backward((q_out, k_out), (grad_q.double(), grad_k.double()))
    return q_out.detach(), k_out.detach(), q.grad, k.grad


def heads(batch, n_heads, seq, head_dim, dtype, layout, g):
    """[B, H, S, D] laid out as HF's transposed view of [B, S, H, D], a slice of a wider fused projection
    (Phi-3's qkv), or contiguous."""
    if layout == "contiguous":
        return torch.randn(batch, n_heads, seq, head_dim, generator=g).to(DEVICE, dtype)
    width = n_heads * head_dim
    x = torch.randn(batch, seq, width + (3 * head_dim if layout == "sliced" else 0), generator=g)
    return x.to(DEVICE, dtype)[..., :width].view(batch, seq, n_heads, head_dim).transpose(1, 2)


def inputs(batch, q_heads, k_heads, seq, head_dim, rot, dtype, layout, cos_batch, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, grad_q, grad_k = (heads(batch, h, seq, head_dim, dtype, layout, g) for h in (q_heads, k_heads) * 2)
    # cos/sin read through strides too: a slice of a wider buffer
    cos, sin = (torch.randn(cos_batch, seq, rot + 6, generator=g).to(DEVICE, dtype)[..., :rot] for _ in range(2))
    return q, k, cos, sin, grad_q, grad_k


def check_kernels(args, dtype):
    q, k, cos, sin, grad_q, grad_k = args
    outs = kernels.rope_forward(q, k, cos, sin) + kernels.rope_backward(grad_q, grad_k, cos, sin)
    for out, ref in zip(outs, exact(*args)):
        assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
        # fp32 math, rounded once to dtype (the incoming gradient, like the input, is exact in fp64)
        assert relative_error(out, ref) <= TOL[dtype]


HEADS = [(4, 4), (4, 2), (8, 1), (3, 1)]  # (q heads, k heads): MHA and GQA


@settings(max_examples=30)
@given(batch=st.sampled_from([1, 2]), q_k_heads=st.sampled_from(HEADS), seq=st.sampled_from([1, 7, 33]),
       head_dim=st.sampled_from([64, 80, 128, 256]), rotary=st.sampled_from([1.0, 0.75, 0.5, 0.25]),
       dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["transposed", "sliced", "contiguous"]),
       cos_batch=st.sampled_from(["one", "batch"]), seed=st.integers(0, 1000))
def test_kernels_match_fp64(batch, q_k_heads, seq, head_dim, rotary, dtype, layout, cos_batch, seed):
    rot = int(head_dim * rotary) // 2 * 2
    args = inputs(batch, *q_k_heads, seq, head_dim, rot, dtype, layout, 1 if cos_batch == "one" else batch, seed)
    check_kernels(args, dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton interpreter computes bf16 wrong: bf16 is checked on CUDA")
@pytest.mark.parametrize("head_dim, rot", [(64, 64), (80, 80), (128, 128), (128, 96), (256, 256)])
def test_kernels_bf16_on_cuda(head_dim, rot):
    check_kernels(inputs(2, 8, 2, 100, head_dim, rot, torch.bfloat16, "transposed", 1, 0), torch.bfloat16)


def test_kernels_empty_and_single_row():
    for seq in (0, 1):
        args = inputs(1, 2, 1, seq, 64, 64, torch.float32, "transposed", 1, 0)
        outs = kernels.rope_forward(*args[:4])
        assert [o.shape for o in outs] == [args[0].shape, args[1].shape]
        if seq:
            assert all(relative_error(o, r) <= 1e-6 for o, r in zip(outs, exact(*args)))


def test_reference_is_hf_formula_and_its_derivative():
    q, k, cos, sin, grad_q, grad_k = (t.double().cpu() for t in inputs(2, 4, 2, 5, 80, 60, torch.float32,
                                                                        "transposed", 2, 7))
    expected = exact(q, k, cos, sin, grad_q, grad_k)
    got = reference.rope(q, k, cos, sin) + reference.rope_backward(grad_q, grad_k, cos, sin)
    assert all(relative_error(a, b) <= 1e-14 for a, b in zip(got, expected))


OPCHECK_SAMPLES = {  # (batch, q heads, k heads, seq, head_dim, rotary dim, dtype, layout, cos batch)
    "fp32_full_transposed": (2, 4, 2, 5, 16, 16, torch.float32, "transposed", 1),
    "bf16_partial_sliced": (2, 4, 1, 3, 16, 8, torch.bfloat16, "sliced", 2),
    "fp16_contiguous": (1, 2, 2, 4, 8, 8, torch.float16, "contiguous", 1),
}


@pytest.mark.parametrize("name", OPCHECK_SAMPLES)
def test_opcheck(name):
    q, k, cos, sin, grad_q, grad_k = inputs(*OPCHECK_SAMPLES[name], seed=1)
    q.requires_grad_(), k.requires_grad_()
    result = torch.library.opcheck(OP, (q, k, cos, sin))
    assert result and set(result.values()) == {"SUCCESS"}, result
    result = torch.library.opcheck(BACKWARD, (grad_q, grad_k, cos, sin))
    assert result and set(result.values()) == {"SUCCESS"}, result


def test_op_gradcheck_in_fp64():
    # CPU: the op's body is the reference, fp64 throughout; partial rotary, GQA, a transposed q
    q, k, cos, sin, _, _ = (t.double().cpu() for t in inputs(2, 2, 1, 3, 8, 6, torch.float32, "transposed", 1, 5))
    q.requires_grad_(), k.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: OP(a, b, cos, sin), (q, k))


def test_bad_inputs_are_clear_errors():
    q, k, cos, sin, _, _ = inputs(2, 4, 2, 5, 16, 16, torch.float32, "contiguous", 1, 0)
    with pytest.raises(RuntimeError, match=r"must be \[batch, heads, seq, head_dim\]"):
        OP(q[0], k[0], cos, sin)
    with pytest.raises(RuntimeError, match="differ in batch, seq or head_dim"):
        OP(q, k[..., :8], cos, sin)
    with pytest.raises(RuntimeError, match="must be even and within head_dim"):
        OP(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(RuntimeError, match="do not broadcast over q"):
        OP(q, k, cos[:, :4], sin[:, :4])
    with pytest.raises(RuntimeError, match="computes no gradient for cos or sin"):
        OP(q.requires_grad_(), k, cos.requires_grad_(), sin)[0].sum().backward()


# --- the pass on tiny HF models --------------------------------------------------------------------------

MODELS = [("llama", {}), ("qwen2", {}), ("mistral", {}), ("gemma", {}), ("phi3", {}),
          ("phi3", {"partial_rotary_factor": 0.5})]


def logits_of(model):
    return lambda ids: model(input_ids=ids).logits


@pytest.mark.parametrize("arch, overrides", MODELS, ids=["llama", "qwen2", "mistral", "gemma", "phi3", "phi3_partial"])
def test_pass_fuses_q_and_k_of_every_attention_layer(arch, overrides):
    model = tiny_lora_model(arch, **overrides)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    gm, example, expected, report, fused = run_pass(fuse_rope, logits_of(model), ids)
    assert fused == layers == count_calls(gm, OP) == len(report.fusions) and report.misses == []
    assert [r.module.rsplit("model.", 1)[-1] for r in report.fusions] == [f"layers.{i}.self_attn"
                                                                          for i in range(layers)]
    assert count_calls(gm, torch.neg) == 0  # no rotate_half left
    cos_sin = [n.args[2:] for n in gm.graph.nodes if n.target == OP]
    rot = int(16 * overrides.get("partial_rotary_factor", 1))  # head_dim 16
    assert all(tuple(c.meta["example_value"].shape) == (1, 16, rot) for args in cos_sin for c in args)  # HF's
    # [1, seq, rotary_dim], before its unsqueeze
    assert relative_error(first_output(gm, example), expected) <= 1e-6


def test_pass_in_bf16_stays_within_rounding_of_eager():
    """In bf16 the fused op rounds once where HF rounds after every product, so the logits differ from the unfused
    graph's by rounding: both are measured against the model run in fp64, with test_end_to_end.py's bound."""
    model = tiny_lora_model("llama", torch.bfloat16)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    exact_logits = logits_of(copy.deepcopy(model).double())(ids)
    gm, example, unfused, report, fused = run_pass(fuse_rope, logits_of(model), ids)
    assert fused == 2 and report.misses == []
    fused_error, eager_error = (relative_error(out, exact_logits) for out in (first_output(gm, example), unfused))
    assert fused_error <= 2 * eager_error + 1e-3, (fused_error, eager_error)


# --- the pass on synthetic rotations: any shape it fuses gives the same numbers; the rest is a miss --------

def apply_rope(q, k, cos, sin):
    """Phi-3's form for partial rotary, Llama's for full; one output tensor, for run_pass."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q_out, k_out = hf_rope(q, k, cos, sin) if cos.shape[-1] < q.shape[-1] else (_rope_full(q, c, s),
                                                                                 _rope_full(k, c, s))
    return torch.cat([q_out, k_out], dim=1)


def _rope_full(x, cos, sin):  # Llama's form: no slice of q before rotate_half
    return (x * cos) + (rotate_half(x) * sin)


@settings(max_examples=10)
@given(q_k_heads=st.sampled_from(HEADS), head_dim=st.sampled_from([16, 80]), rotary=st.sampled_from([1.0, 0.5]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), cos_batch=st.sampled_from([1, 2]),
       layout=st.sampled_from(["transposed", "contiguous"]))
def test_pass_fuses_any_shape_with_unchanged_numbers(q_k_heads, head_dim, rotary, dtype, cos_batch, layout):
    g = torch.Generator().manual_seed(0)
    rot = int(head_dim * rotary)
    q, k = (heads(2, h, 5, head_dim, dtype, layout, g).cpu() for h in q_k_heads)
    cos, sin = (torch.randn(cos_batch, 5, rot, generator=g).to(dtype) for _ in range(2))
    gm, example, expected, report, fused = run_pass(fuse_rope, apply_rope, q, k, cos, sin)
    assert fused == 1 == count_calls(gm, OP) and report.misses == []
    # one rounding instead of HF's three: within a rounding or two of the unfused graph
    tolerance = 1e-6 if dtype == torch.float32 else 2 * TOL[dtype]
    assert relative_error(first_output(gm, example), expected) <= tolerance


def gpt_oss_rope(q, k, cos, sin):  # GPT-OSS's form: q and k chunked, cos and sin of half head_dim
    def rotate(x, c, s):
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((first * c - second * s, second * c + first * s), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([rotate(q, c, s), rotate(k, c, s)], dim=1)


@settings(max_examples=10)
@given(q_k_heads=st.sampled_from(HEADS), head_dim=st.sampled_from([16, 80]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), cos_batch=st.sampled_from([1, 2]),
       layout=st.sampled_from(["transposed", "contiguous"]))
def test_pass_fuses_gpt_oss_rotations_with_unchanged_numbers(q_k_heads, head_dim, dtype, cos_batch, layout):
    """The op gets GPT-OSS's cos and sin repeated over both halves: the rotation rotate_half's form computes."""
    g = torch.Generator().manual_seed(0)
    q, k = (heads(2, h, 5, head_dim, dtype, layout, g).cpu() for h in q_k_heads)
    cos, sin = (torch.randn(cos_batch, 5, head_dim // 2, generator=g).to(dtype) for _ in range(2))
    gm, example, expected, report, fused = run_pass(fuse_rope, gpt_oss_rope, q, k, cos, sin)
    assert fused == 1 == count_calls(gm, OP) and report.misses == [] and count_calls(gm, torch.chunk) == 0
    tolerance = 1e-6 if dtype == torch.float32 else 2 * TOL[dtype]
    assert relative_error(first_output(gm, example), expected) <= tolerance


@pytest.mark.parametrize("rotary", [16, 8])
def test_cos_sin_that_promote_the_rotation_fuse_with_q_and_k_cast_up(rotary):
    """bf16 q and k rotated by fp32 cos/sin (an fp32 model under bf16 autocast: the projections are bf16, HF's cos
    and sin take the fp32 hidden states' dtype) give fp32 in eager: the op gets q and k cast up and computes the
    same fp32 rotation."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 5, 16, generator=g).to(torch.bfloat16) for h in (4, 2))
    cos, sin = (torch.randn(1, 5, rotary, generator=g) for _ in range(2))
    gm, example, expected, report, fused = run_pass(fuse_rope, apply_rope, q, k, cos, sin)
    assert fused == 1 and report.misses == []
    out = first_output(gm, example)
    assert out.dtype == expected.dtype == torch.float32
    assert relative_error(out, expected) <= 1e-6


def lone_q(q, k, cos, sin):
    return torch.cat([_rope_full(q, cos.unsqueeze(1), sin.unsqueeze(1)), k], dim=1)


def rotate_half_reused(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = rotate_half(q)
    return torch.cat([q * cos + rotated * sin + rotated, _rope_full(k, cos, sin)], dim=1)


def lower_half_negated(q, k, cos, sin):
    def rotate(x):
        return torch.cat((-x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([q * cos + rotate(q) * sin, k * cos + rotate(k) * sin], dim=1)


def seq_major(q, k, cos, sin):  # rotated as [B, S, H, D], with HF's unsqueeze_dim=2
    q_out, k_out = (_rope_full(x.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)) for x in (q, k))
    return torch.cat([q_out.transpose(1, 2), k_out.transpose(1, 2)], dim=1)


def without_heads(q, k, cos, sin):  # [B, S, D]: cos/sin broadcast without an unsqueeze
    return torch.cat([_rope_full(x[:, 0], cos, sin) for x in (q, k)], dim=1)


def k_from_rotated_q(q, k, cos, sin):  # no single point where both inputs exist and neither output is used
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_out = _rope_full(q, cos, sin)
    return torch.cat([q_out, _rope_full(k + q_out[:, :2], cos, sin)], dim=1)


def interleaved(q, k, cos, sin):  # Cohere's, GLM's and Helium's rotate_half: adjacent features paired
    def rotate(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([q * cos + rotate(q) * sin, k * cos + rotate(k) * sin], dim=1)


def flat_rope(q, k, cos, sin):  # q and k of different batch sizes (one output tensor, whatever the shapes)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([_rope_full(q, c, s).flatten(), _rope_full(k, c, s).flatten()])


@pytest.mark.parametrize("model, change, reasons", [
    (lone_q, {}, ["a lone q or k rotation"]),
    (rotate_half_reused, {}, ["is also read outside it", "a lone q or k rotation"]),
    (lower_half_negated, {}, ["is not rotate_half"] * 2),
    (interleaved, {}, ["interleaved rotary"] * 2),
    (seq_major, {}, ["unsqueezed at dim 1"] * 2),
    (without_heads, {}, ["not [batch, heads, seq, head_dim]"] * 2),
    (k_from_rotated_q, {}, ["k's input is computed after q's rotation is used"] * 2),
    (flat_rope, {"k_batch": 3}, ["q and k differ in batch"] * 2),
    (apply_rope, {"cos_seq": 1}, ["do not broadcast as [batch or 1, seq, 16]"] * 2),
    (apply_rope, {"cos_requires_grad": True}, ["require grad"] * 2),
    (apply_rope, {"dtype": torch.float64}, ["not float32/bfloat16/float16"] * 2),
])
def test_unprovable_rotations_stay_unfused_with_a_reason(model, change, reasons):
    g = torch.Generator().manual_seed(0)
    dtype = change.get("dtype", torch.float32)
    q, k = (torch.randn(b, h, 5, 16, generator=g).to(dtype) for b, h in ((2, 4), (change.get("k_batch", 2), 2)))
    cos, sin = (torch.randn(1, change.get("cos_seq", 5), 16, generator=g).to(change.get("cos_dtype", dtype))
                for _ in range(2))
    if change.get("cos_requires_grad"):
        cos.requires_grad_(), sin.requires_grad_()
    gm, example, expected, report, fused = run_pass(fuse_rope, model, q, k, cos, sin)
    assert fused == 0 and count_calls(gm, OP) == 0 and report.fusions == []
    assert sorted(r for m in report.misses for r in set(reasons) if r in m.reason) == sorted(reasons)
    assert len(report.misses) == len(reasons)
    torch.testing.assert_close(first_output(gm, example), expected, rtol=0, atol=0)
