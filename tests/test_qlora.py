"""QLoRA: graphopt::lora_linear_4bit (lowering/ops.py) and its fusion (passes/fuse_lora.py) around bitsandbytes'
4-bit bases. The op against an fp64 computation on the weight bitsandbytes itself dequantizes (NF4 and FP4, double
quantization or not, block sizes 64 and 128, odd feature counts, ranks up to 128, with and without dropout);
opcheck; tiny HF models loaded with BitsAndBytesConfig(load_in_4bit=True) and PEFT LoRA, compiled: every 4-bit
layer fused, loss and every LoRA gradient equal to eager, the packed base unchanged by training."""

import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

import graphopt
from graphs import relative_error
from models import ARCHITECTURES, COMMON

bnb = pytest.importorskip("bitsandbytes")
import peft  # noqa: E402
import transformers  # noqa: E402
from bitsandbytes import functional as bnb_functional  # noqa: E402

OP = torch.ops.graphopt.lora_linear_4bit.default
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def lora_4bit(x, base, lora_a, lora_b, scaling, out_dtype, *dropout):
    """A QLoRA linear as the pass writes it: lora_down, then lora_linear_4bit taking its x·Aᵀ."""
    xa = torch.ops.graphopt.lora_down(x, lora_a, *dropout)
    return OP(x, *base, lora_a, lora_b, xa, scaling, out_dtype, *dropout)


def quantized(out_features, in_features, quant_type, blocksize, nested, seed=0):
    """(bitsandbytes::gemm_4bit's base arguments, the weight bitsandbytes dequantizes them to) of a random weight."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type,
                                                 compress_statistics=nested)
    absmax = (state.state2.absmax, state.absmax, state.state2.code, state.offset) if nested else (
        state.absmax, None, None, None)
    args = (packed, [out_features, in_features], absmax[0], blocksize, quant_type, None, *absmax[1:])
    return args, bnb_functional.dequantize_4bit(packed, state)


def expected(x, weight, lora_a, lora_b, scaling, keep, p):
    """(output, grad_x, grad_a, grad_b) of sum(output · probe) in fp64, the base weight as bitsandbytes gives it."""
    x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, lora_a, lora_b))
    dropped = x64 if keep is None else x64 * keep / (1 - p)
    out = x64 @ weight.double().t() + scaling * (dropped @ a64.t()) @ b64.t()
    probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float64, device=out.device).reshape(out.shape)
    return (out, *torch.autograd.grad((out * probe).sum(), (x64, a64, b64))), probe


@settings(max_examples=24, deadline=None)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), blocksize=st.sampled_from([64, 128]), nested=st.booleans(),
       out_features=st.integers(1, 48), in_features=st.integers(1, 48).map(lambda n: 2 * n + 1),
       rank=st.sampled_from([1, 4, 16, 128]), rows=st.integers(1, 9), dtype=st.sampled_from(list(TOLERANCE)),
       dropout=st.booleans())
def test_matches_fp64_on_the_weight_bitsandbytes_dequantizes(quant_type, blocksize, nested, out_features,
                                                              in_features, rank, rows, dtype, dropout):
    args, weight = quantized(out_features, in_features, quant_type, blocksize, nested)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=g).to(dtype).requires_grad_()
    lora_a = (torch.randn(rank, in_features, generator=g) / in_features ** 0.5).requires_grad_()
    lora_b = (torch.randn(out_features, rank, generator=g) / rank ** 0.5).requires_grad_()
    keep, p = (torch.rand(x.shape, generator=g) > 0.3, 0.3) if dropout else (None, 0.0)
    out = lora_4bit(x, args, lora_a, lora_b, 0.5, dtype, *((keep, p) if dropout else ()))
    (want, *want_grads), probe = expected(x, weight.to(dtype), lora_a, lora_b, 0.5, keep, p)
    grads = torch.autograd.grad((out.double() * probe).sum(), (x, lora_a, lora_b))
    assert out.dtype == dtype
    for got, wanted in zip((out, *grads), (want, *want_grads)):
        assert relative_error(got, wanted) <= TOLERANCE[dtype]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=30, deadline=None)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), blocksize=st.sampled_from([64, 128, 256]), nested=st.booleans(),
       out_features=st.integers(1, 300), in_features=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.float16] + [torch.bfloat16] * (DEVICE == "cuda")))
def test_the_one_launch_dequantization_is_bitsandbytes_own(quant_type, blocksize, nested, out_features, in_features,
                                                           dtype):
    """kernels/dequantize_4bit.py (the interpreter on CPU, compiled on CUDA) against bitsandbytes' dequantization
    on the same device, odd element counts included: equal, bit for bit. bitsandbytes is asked for the weight as
    one row, the order its format stores: its CPU kernel (0.50.2) scales blocks that span rows by another block's
    absmax for some even row lengths (5 × 16 and 6 × 32 at block size 64, off the weight by up to 5 times the
    quantization error), which eager and graphopt's CPU path share."""
    from graphopt.kernels import dequantize_4bit, reference

    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type,
                                                 compress_statistics=nested)
    absmax = (state.state2.absmax, state.absmax, state.state2.code, state.offset) if nested else (
        state.absmax, None, None, None)
    got = dequantize_4bit.dequantize_4bit(packed, [out_features, in_features], absmax[0], blocksize, quant_type,
                                          *absmax[1:], dtype)
    want = reference.dequantize_4bit(packed, [1, out_features * in_features], absmax[0], blocksize, quant_type,
                                     *absmax[1:], dtype).reshape(out_features, in_features)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("nested", [False, True])
def test_opcheck(nested):
    args, _ = quantized(24, 40, "nf4", 64, nested)
    x = torch.randn(3, 40, requires_grad=True)
    lora_a, lora_b = torch.randn(8, 40, requires_grad=True), torch.randn(24, 8, requires_grad=True)
    xa = (x @ lora_a.t()).detach()
    torch.library.opcheck(OP, (x, *args, lora_a, lora_b, xa, 2.0, torch.float32))


def test_a_bad_packed_weight_is_refused():
    args, _ = quantized(24, 40, "nf4", 64, False)
    with pytest.raises(RuntimeError, match="packed must hold the"):
        lora_4bit(torch.randn(2, 40), (args[0][:-1], *args[1:]), torch.randn(4, 40), torch.randn(24, 4), 1.0,
                  torch.float32)


def qlora_model(arch, quant_type="nf4", nested=True, compute_dtype=torch.float32, dtype=torch.float32, device="cpu"):
    """A tiny HF model saved, loaded back in dtype with a bitsandbytes 4-bit base, and given LoRA on every linear
    (its adapters in fp32, PEFT's default)."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        model_cls(config_cls(**COMMON, **extra)).save_pretrained(directory)
        quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                       bnb_4bit_use_double_quant=nested,
                                                       bnb_4bit_compute_dtype=compute_dtype)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization,
                                                                  device_map=device, dtype=dtype)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, lora).train()


def loss_and_grads(model, ids, forward=None):
    """The loss of forward (model itself, or model compiled) and the gradients it leaves in model's adapters."""
    model.zero_grad(set_to_none=True)
    loss = (model if forward is None else forward)(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch, quant_type, nested", [("llama", "nf4", True), ("qwen2", "fp4", False),
                                                       ("gemma", "nf4", False)])
def test_qlora_models_fuse_every_4bit_layer_and_train_as_eager(arch, quant_type, nested, fresh_dynamo):
    model = qlora_model(arch, quant_type, nested)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    packed = {n: p.clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    eager_loss, eager_grads = loss_and_grads(model, ids)
    loss, grads = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
    report = graphopt.last_report()
    assert report.summary().get("lora_4bit") == 7 * COMMON["num_hidden_layers"] and "lora" not in report.summary()
    assert not [m for m in report.misses if m.pattern == "lora"]
    assert relative_error(loss, eager_loss) <= 1e-5
    assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in eager_grads)
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    assert all(torch.equal(p, packed[n]) for n, p in model.named_parameters() if p.dtype == torch.uint8)
    assert any("lora_linear_4bit" in r.op for r in report.lowering)
    # memory_budget="auto" sizes the plan to the weights at their dequantized size (fp32 here), as unquantized
    dense = sum(m.in_features * m.out_features * 4 for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    rest = sum(p.nbytes for p in model.parameters() if p.dtype != torch.uint8)
    assert report.saved_for_backward["auto"]["weights_bytes"] == dense + rest


def test_a_base_computing_in_another_dtype_stays_unfused(fresh_dynamo):
    """bnb_4bit_compute_dtype bf16 under an fp32 model: eager rounds the base through bf16, the op would not."""
    model = qlora_model("llama", compute_dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    eager_loss, _ = loss_and_grads(model, ids)
    loss, _ = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
    misses = [m for m in graphopt.last_report().misses if m.pattern == "lora"]
    assert len(misses) == 14 and all("computes in torch.bfloat16" in m.reason for m in misses)
    assert relative_error(loss, eager_loss) <= 1e-5


def test_bf16_qlora_fuses_and_trains_as_eager_within_bf16(fresh_dynamo):
    """The usual QLoRA set-up: a bf16 model computing its 4-bit base in bf16, fp32 adapters (PEFT's bnb layer casts
    their output to bf16 before the add; the op adds in fp32 and rounds once)."""
    model = qlora_model("llama", compute_dtype=torch.bfloat16, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_grads = loss_and_grads(model, ids)
    loss, grads = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
    assert graphopt.last_report().summary().get("lora_4bit") == 7 * COMMON["num_hidden_layers"]
    assert torch.allclose(loss, eager_loss, atol=1e-2, rtol=5e-2)  # Liger's bf16 convergence tolerances
    assert all(relative_error(grads[n], eager_grads[n]) <= 5e-2 for n in eager_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlora_under_autocast_fuses_and_trains_as_eager(dtype, fresh_dynamo):
    """HF's bf16=True on a QLoRA model: bitsandbytes computes the base in bf16 (its compute dtype), the adapters
    run in autocast's bf16, and PEFT adds the base cast back to the model's dtype (fp32 where
    prepare_model_for_kbit_training left the rest of the model in fp32)."""
    model = qlora_model("llama", compute_dtype=torch.bfloat16, dtype=dtype)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", torch.bfloat16):
        eager_loss, eager_grads = loss_and_grads(model, ids)
        loss, grads = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
    report = graphopt.last_report()
    assert report.summary().get("lora_4bit") == 7 * COMMON["num_hidden_layers"]
    assert not [m for m in report.misses if m.pattern == "lora"]
    assert torch.allclose(loss, eager_loss, atol=1e-2, rtol=5e-2)  # Liger's bf16 convergence tolerances
    assert all(relative_error(grads[n], eager_grads[n]) <= 5e-2 for n in eager_grads)
    assert all(grads[n].dtype == eager_grads[n].dtype for n in eager_grads)


def test_a_base_computing_in_another_dtype_than_autocast_stays_unfused(fresh_dynamo):
    """An fp32 compute dtype under bf16 autocast: eager's base stays fp32 while its adapters drop to bf16."""
    model = qlora_model("llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", torch.bfloat16):
        eager_loss, _ = loss_and_grads(model, ids)
        loss, _ = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
    misses = [m for m in graphopt.last_report().misses if m.pattern == "lora"]
    assert len(misses) == 14 and all("under torch.autocast to torch.bfloat16" in m.reason for m in misses)
    assert torch.allclose(loss, eager_loss, atol=1e-2, rtol=5e-2)


def test_an_8bit_base_is_a_miss_that_says_so(fresh_dynamo):
    """LLM.int8 (load_in_8bit): a miss naming it where bitsandbytes' int8 matmul runs; where no input needs a
    gradient (the first layer's q, k, v) bitsandbytes computes a plain linear of the weight it dequantizes, which
    fuses as any linear. The numbers are eager's either way."""
    config_cls, model_cls, extra = ARCHITECTURES["llama"]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        model_cls(config_cls(**COMMON, **extra)).save_pretrained(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True), device_map="cpu")
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_grads = loss_and_grads(model.train(), ids)
    loss, grads = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
    report = graphopt.last_report()
    misses = [m for m in report.misses if m.pattern == "lora"]
    assert len(misses) + report.summary().get("lora", 0) == 14 and len(misses) >= 11
    assert all("8-bit base (bitsandbytes' LLM.int8, load_in_8bit)" in m.reason for m in misses)
    assert relative_error(loss, eager_loss) <= 1e-5
    assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in eager_grads)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' CUDA kernels need a GPU")


@CUDA
@pytest.mark.parametrize("quant_type, nested", [("nf4", True), ("fp4", False)])
def test_cuda_op_matches_fp64(quant_type, nested):
    """On the GPU the base is dequantized by bitsandbytes' CUDA kernels; bf16 input, fp32 adapters."""
    weight = torch.randn(96, 200, generator=torch.Generator().manual_seed(0)).cuda()
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type=quant_type,
                                                 compress_statistics=nested)
    absmax = (state.state2.absmax, state.absmax, state.state2.code, state.offset) if nested else (
        state.absmax, None, None, None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 200, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    lora_a = (torch.randn(16, 200, generator=g) / 200 ** 0.5).cuda().requires_grad_()
    lora_b = (torch.randn(96, 16, generator=g) / 4).cuda().requires_grad_()
    out = lora_4bit(x, (packed, [96, 200], absmax[0], 64, quant_type, None, *absmax[1:]), lora_a, lora_b, 0.5,
                    torch.bfloat16)
    dequantized = bnb_functional.dequantize_4bit(packed, state).to(torch.bfloat16)
    (want, *want_grads), probe = expected(x, dequantized, lora_a, lora_b, 0.5, None, 0.0)
    grads = torch.autograd.grad((out.double() * probe).sum(), (x, lora_a, lora_b))
    for got, wanted in zip((out, *grads), (want, *want_grads)):
        assert relative_error(got.cpu(), wanted.cpu()) <= TOLERANCE[torch.bfloat16]


@CUDA
@pytest.mark.parametrize("dtype, autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_cuda_qlora_model_fuses_and_trains_as_eager(dtype, autocast, fresh_dynamo):
    """A bf16 QLoRA model, and HF's bf16=True (autocast) on one whose other weights stay fp32."""
    model = qlora_model("llama", compute_dtype=torch.bfloat16, dtype=dtype, device="cuda")
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        eager_loss, eager_grads = loss_and_grads(model, ids)
        loss, grads = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
    report = graphopt.last_report()
    assert report.summary().get("lora_4bit") == 7 * COMMON["num_hidden_layers"]
    ran = {r.op: r.implementation for r in report.lowering}["graphopt.lora_linear_4bit.default"]
    assert "kernels/dequantize_4bit.py" in ran
    # after dequantizing: the LoRA kernels with fp32 adapters; autocast's bf16 adapters, as eager's, in cuBLAS
    assert ("kernels/lora.py" in ran) != autocast and ("kernels/reference.py" in ran) == autocast
    assert torch.allclose(loss, eager_loss, atol=1e-2, rtol=5e-2)
    assert all(relative_error(grads[n], eager_grads[n]) <= 5e-2 for n in eager_grads)
    assert all(grads[n].dtype == eager_grads[n].dtype for n in eager_grads)


@CUDA
def test_cuda_graphs_replay_the_qlora_model(monkeypatch, fresh_dynamo):
    """Under CUDA graphs (a tree's warm-up, recording, then replays) the 4-bit base's dequantization table is made
    before the graph compiles, outside the tree's memory pool, where a tensor that outlives a run must be one of
    its outputs: three steps run, the last equal to eager."""
    from graphopt.kernels import dequantize_4bit

    monkeypatch.setattr(dequantize_4bit, "_values", {})
    model = qlora_model("llama", compute_dtype=torch.bfloat16, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    compiled = torch.compile(model, backend="graphopt", options={"cuda_graphs": True})
    for _ in range(3):
        loss, grads = loss_and_grads(model, ids, compiled)
    eager_loss, eager_grads = loss_and_grads(model, ids)
    assert torch.allclose(loss, eager_loss, atol=1e-2, rtol=5e-2)
    assert all(relative_error(grads[n], eager_grads[n]) <= 5e-2 for n in eager_grads)
