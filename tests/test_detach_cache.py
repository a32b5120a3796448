"""The cache policy (passes/detach_cache.py): in training, the KV cache a model returns is detached (no gradient
input for it in the backward), with the same values as eager; cache_grad=True keeps it differentiable."""

import pytest
import torch

import graphopt
from graphs import relative_error
from models import tiny_lora_model
from graphopt.options import OptionError, parse_options
from graphopt.passes.registry import FUSIONS


def cache_tensors(outputs):
    return [t for layer in outputs.past_key_values.layers for t in (layer.keys, layer.values)]


def step(model, ids, compile_options=None, attention_mask=None):
    """(loss, LoRA gradients, the returned cache tensors) of one forward + backward, compiled when options given."""
    torch._dynamo.reset()
    forward = model if compile_options is None else torch.compile(model, backend="graphopt", options=compile_options)
    model.zero_grad(set_to_none=True)
    labels = ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -100)
    outputs = forward(input_ids=ids, labels=labels, attention_mask=attention_mask, use_cache=True)
    outputs.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return outputs.loss.detach(), grads, cache_tensors(outputs)


@pytest.fixture
def materialized_masks(monkeypatch):
    """transformers as 5.17 runs under torch.compile: k and v reach attention through repeat_kv's expand and
    reshape."""
    import transformers.masking_utils

    monkeypatch.setattr(transformers.masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)


@pytest.mark.parametrize("attention_pass", [True, False], ids=["gqa_rewritten", "repeat_kv_left"])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_training_returns_the_cache_detached_with_eager_values(arch, attention_pass, materialized_masks):
    model = tiny_lora_model(arch)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_grads, eager_cache = step(model, ids)
    assert all(t.requires_grad for t in eager_cache)  # what costs the zero gradients without the pass

    loss, grads, cache = step(model, ids, {"fusions": {"attention": attention_pass}})
    assert relative_error(loss, eager_loss) <= 1e-5
    assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in eager_grads)
    assert len(cache) == len(eager_cache) == 2 * model.config.num_hidden_layers
    assert not any(t.requires_grad for t in cache)
    assert all(relative_error(t, e) <= 1e-5 for t, e in zip(cache, eager_cache))
    assert f"KV cache: {len(cache)} key/value outputs returned detached" in graphopt.last_report().to_text()


def test_padded_attention_cache_is_detached_too():
    """With padding, the attention layers become graphopt::padded_attention: the k and v it reads are the cache's,
    equal to eager's at the kept positions."""
    model = tiny_lora_model("llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    eager_loss, eager_grads, eager_cache = step(model, ids, attention_mask=mask)
    loss, grads, cache = step(model, ids, {}, attention_mask=mask)
    assert graphopt.last_report().summary()["attention_padded"] == model.config.num_hidden_layers
    assert relative_error(loss, eager_loss) <= 1e-5
    assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in eager_grads)
    assert not any(t.requires_grad for t in cache)
    kept = mask.bool()[:, None, :, None]  # at padding positions, values the op defines differently (0 outputs)
    assert all(relative_error(t * kept, e * kept) <= 1e-5 for t, e in zip(cache, eager_cache))


def test_cache_grad_keeps_the_cache_differentiable():
    model = tiny_lora_model("llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    _, _, cache = step(model, ids, {"cache_grad": True})
    assert cache and all(t.requires_grad for t in cache)
    assert "KV cache" not in graphopt.last_report().to_text()


@pytest.mark.parametrize("value", [1, "no", None])
def test_cache_grad_must_be_a_bool(value):
    with pytest.raises(OptionError, match="cache_grad must be True or False"):
        parse_options({"cache_grad": value}, tuple(FUSIONS))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_lean_mode_frees_the_cache_the_caller_drops(device):
    """HF's Trainer keeps the loss of the outputs only: the lean mode recomputes the attention's k and v in the
    backward, so the returned cache, once dropped, must not stay alive through the backward (2 × layers × [batch,
    kv heads, length, head dim]: 615 MiB at the Llama-3-8B shape)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_lora_model("llama", dtype=dtype).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options={"memory_budget": 0, "offload": True})
    for length in (16, 24):  # the second compiles the length symbolic, as a Trainer's second batch does
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length)).to(device)
        mask = torch.ones_like(ids)
        mask[1, length - 5:] = 0
        outputs = compiled(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask,
                           use_cache=True)
        storages = [t.untyped_storage()._weak_ref() for t in cache_tensors(outputs)]
        loss = outputs.loss
        del outputs
        assert graphopt.last_report().summary()["attention_padded"] == model.config.num_hidden_layers
        assert all(torch.UntypedStorage._expired(s) for s in storages)
        loss.backward()
