"""Mixed precision: every graphopt op computes what eager computes under torch.autocast — HF's bf16=True (fp32
weights under autocast), a bf16 base with fp32 adapters (PEFT's default), bf16 adapters, fp16 with a GradScaler,
and an autocast region traced inside the compiled forward (accelerate's wrapped forward) — with the fusions found
without autocast."""

import pytest
import torch

import graphopt
from graphs import relative_error
from models import DISTINCT, adapted_layers, rms_norm_modules, tiny_lora_model

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
# on the GPU: the same comparisons under CUDA autocast, with the Triton lowering
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def loss_and_grads(model, autocast_dtype, inside=False):
    """Loss and every trainable gradient of one step; autocast around the call, or (inside) in the forward."""
    model.zero_grad(set_to_none=True)
    enabled = autocast_dtype is not None
    device = next(model.parameters()).device
    ids = IDS.to(device)
    if inside:
        with torch.autocast(device.type, autocast_dtype, enabled=enabled):
            loss = model(input_ids=ids, labels=ids).loss
    else:
        loss = model(ids, autocast_dtype)
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in params if p.requires_grad}


class AutocastInside(torch.nn.Module):
    """The forward enters autocast itself, as accelerate's prepared model does: Dynamo records the region."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, autocast_dtype):
        with torch.autocast(ids.device.type, autocast_dtype):
            return self.model(input_ids=ids, labels=ids).loss


def assert_matches_eager_under_autocast(model, autocast_dtype, inside=False):
    """Compiled and eager under the same autocast, both measured against the model in fp64 without it: the
    compiled error may exceed eager's own only by rounding noise (bf16/fp16 tolerances)."""
    run = AutocastInside(model) if inside else model
    torch._dynamo.reset()
    loss, grads = loss_and_grads(torch.compile(run, backend="graphopt"), autocast_dtype, inside=not inside)
    report = graphopt.last_report()
    eager_loss, eager_grads = loss_and_grads(run, autocast_dtype, inside=not inside)
    dtype = next(model.parameters()).dtype
    exact_loss, exact_grads = loss_and_grads(run.to(torch.float64), None, inside=not inside)
    run.to(dtype)
    assert loss.dtype == eager_loss.dtype
    assert relative_error(loss, exact_loss) <= 2 * relative_error(eager_loss, exact_loss) + 1e-3
    assert set(grads) == set(eager_grads)
    for name in grads:
        assert grads[name].dtype == eager_grads[name].dtype, name
        bound = 2 * relative_error(eager_grads[name], exact_grads[name]) + 1e-2
        assert relative_error(grads[name], exact_grads[name]) <= bound, name
    return report


def fusions(report):
    """{pattern: count} without SDPA's rewrites, which depend on the transformers version (test_end_to_end.py)."""
    return {p: n for p, n in report.summary().items() if not p.startswith("attention_")}


def expected_fusions(model, arch):
    return {"rms_norm": rms_norm_modules(model), "rope": 2, "geglu" if arch == "gemma" else "swiglu": 2,
            "lora": len(adapted_layers(model)), "linear_cross_entropy": 1}


# qwen2's q/k/v bias runs under bf16 autocast in test_autocast_entered_inside_the_compiled_forward
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", DISTINCT)
def test_fp32_weights_under_bf16_autocast(arch, device):
    """HF Trainer's bf16=True: fp32 weights and adapters, the forward under bf16 autocast."""
    model = tiny_lora_model(arch).to(device)
    report = assert_matches_eager_under_autocast(model, torch.bfloat16)
    assert fusions(report) == expected_fusions(model, arch) and report.misses == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adapter_dtype", [torch.float32, None], ids=["fp32 adapters", "bf16 adapters"])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_bf16_base_under_autocast(adapter_dtype, autocast_dtype, device):
    model = tiny_lora_model("llama", torch.bfloat16, adapter_dtype=adapter_dtype).to(device)
    report = assert_matches_eager_under_autocast(model, autocast_dtype)
    assert fusions(report) == expected_fusions(model, "llama") and report.misses == []


def test_autocast_entered_inside_the_compiled_forward():
    model = tiny_lora_model("qwen2")
    report = assert_matches_eager_under_autocast(model, torch.bfloat16, inside=True)
    assert fusions(report) == expected_fusions(model, "qwen2") and report.misses == []


def test_autocast_changes_the_compiled_numbers_as_it_changes_eager():
    """A bf16 base with fp32 adapters: turning autocast on moves eager's loss and gradients (the adapters' matmuls
    drop to bf16), and the compiled ones with them: not bit-identical to the run without autocast."""
    model = tiny_lora_model("gemma", torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt")
    for run in (model, compiled):
        (plain, plain_grads), (cast, cast_grads) = (loss_and_grads(run, dtype, inside=True)
                                                    for dtype in (None, torch.bfloat16))
        assert plain != cast
        assert all(not torch.equal(plain_grads[name], cast_grads[name]) for name in plain_grads)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_autocast_with_grad_scaler_trains_like_eager(device):
    """fp16 autocast with torch's GradScaler: three AdamW steps, compiled and eager in lockstep."""
    losses = {}
    ids = IDS.to(device)
    for compiled in (False, True):
        model = tiny_lora_model("mistral").to(device)
        torch._dynamo.reset()
        run = torch.compile(model, backend="graphopt") if compiled else model
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer, scaler = torch.optim.AdamW(params, lr=1e-2), torch.amp.GradScaler(device)
        losses[compiled] = []
        for _ in range(3):
            with torch.autocast(device, torch.float16):
                loss = run(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            losses[compiled].append(loss.item())
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert losses[True][-1] < losses[True][0]
