"""Tiny (2-layer) configs of the decoder architectures graphopt must handle, with PEFT LoRA on every linear."""

import peft
import torch
import transformers

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 16}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}),
}
# The architectures whose decoder layers differ for graphopt's passes: llama, gemma (GeGLU, its norm's 1 + weight),
# phi3 (fused qkv and gate/up projections, partial rotary). mistral's layers are llama's, qwen2's are llama's with a
# q/k/v bias: the tests that cost CI most run these three only.
DISTINCT = ("gemma", "llama", "phi3")
# The architectures whose padded and packed batches compile at a symbolic length too: llama, and phi3 (fused qkv,
# partial rotary); the others' attention is llama's, and a symbolic compile costs CI twice a static one.
SYMBOLIC_LENGTH = {"llama", "phi3"}
# Architectures that a few tests take by name, outside the suite's parametrization: Gemma-3's text model, a
# sliding-window layer (5 of 6 in the released models) then a full one, each with its own mask.
OTHER_ARCHITECTURES = {
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}),
}


def rms_norm_modules(model) -> int:
    return sum(1 for m in model.modules() if "rmsnorm" in type(m).__name__.lower())


def tiny_lora_model(arch: str, dtype=torch.float32, seed: int = 0, adapter_dtype=torch.float32, lora_dropout=0.0,
                    **overrides):
    """The adapters in fp32 whatever the base's dtype (PEFT's default), or in the base's dtype when adapter_dtype
    is None (PEFT's autocast_adapter_dtype=False)."""
    config_cls, model_cls, extra = {**ARCHITECTURES, **OTHER_ARCHITECTURES}[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(config).to(dtype)
    # init_lora_weights=False: B starts random, not zero, so every LoRA gradient is non-zero and comparable.
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                           lora_dropout=lora_dropout)
    return peft.get_peft_model(model, lora, autocast_adapter_dtype=adapter_dtype is not None)


def adapted_layers(model):
    """Module paths, from the PeftModel as compiled root, of the layers PEFT adapted."""
    return [name for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def tiny_llama():
    """A factory for `graphopt optimize models:tiny_llama` (tests/test_plan_dir.py): the tiny Llama with LoRA."""
    return tiny_lora_model("llama")


def tiny_llama_base():
    """The same without adapters."""
    config_cls, model_cls, _ = ARCHITECTURES["llama"]
    return model_cls(config_cls(**COMMON))
