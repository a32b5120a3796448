"""Decoder architectures beyond models.ARCHITECTURES, as graphopt's fusion passes see their training forward
(Dynamo's graph of the loss, PEFT LoRA on every linear): what fuses, what stays a miss and why, and the fused
graph computing the loss the captured one computes. The five of models.ARCHITECTURES train end to end in the other
tests; these check the passes' reach at the cost of a capture: Qwen3's q/k norms, OLMo-2's norms after the
projections, Gemma-2's and Gemma-3's extra norms and Gemma-2's softcapping, Granite's and Cohere's logit scales,
GPT-OSS's chunked rotary; Cohere's LayerNorm and Cohere's and Helium's interleaved rotary stay misses."""

from collections import Counter

import peft
import pytest
import torch
import transformers

from graphopt.options import Options
from graphopt.passes.registry import FUSIONS
from graphopt.pipeline import normalize_and_fuse
from graphopt.plan import Plan
from graphs import capture, first_output, relative_error
from models import COMMON

SWIGLU = {"rms_norm": 5, "rope": 2, "swiglu": 2, "lora": 14, "linear_cross_entropy": 1}  # Llama's, 2 layers
CASES = {  # the config, then the fusions and the misses (pattern: a phrase of the reason, times) of 2 layers
    "qwen3": (transformers.Qwen3Config(head_dim=16, **COMMON), {**SWIGLU, "rms_norm": 9}, {}),
    "olmo2": (transformers.Olmo2Config(**COMMON), {**SWIGLU, "rms_norm": 9}, {}),
    "gemma2": (transformers.Gemma2Config(head_dim=16, final_logit_softcapping=30.0, **COMMON),
               {"rms_norm": 9, "rope": 2, "geglu": 2, "lora": 14, "linear_cross_entropy": 1}, {}),
    "gemma3": (transformers.Gemma3TextConfig(head_dim=16, **COMMON),
               {"rms_norm": 13, "rope": 2, "geglu": 2, "lora": 14, "linear_cross_entropy": 1}, {}),
    "granite": (transformers.GraniteConfig(logits_scaling=8.0, **COMMON), SWIGLU, {}),
    "gpt_oss": (transformers.GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **COMMON),
                {"rms_norm": 5, "rope": 2, "lora": 8, "linear_cross_entropy": 1}, {}),
    "cohere": (transformers.CohereConfig(logit_scale=0.0625, **COMMON),
               {"swiglu": 2, "lora": 14, "linear_cross_entropy": 1},
               {("rms_norm", "a LayerNorm"): 3, ("rope", "interleaved rotary"): 4}),
    "helium": (transformers.HeliumConfig(head_dim=16, **COMMON),
               {"rms_norm": 5, "swiglu": 2, "lora": 14, "linear_cross_entropy": 1},
               {("rope", "interleaved rotary"): 4}),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_the_passes_find_what_each_architecture_holds(arch):
    config, fusions, misses = CASES[arch]
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    gm, inputs = capture(lambda ids: model(input_ids=ids, labels=ids).loss, ids)
    expected = first_output(gm, inputs)
    plan = Plan(graph=0)
    normalize_and_fuse(gm, Options(fusions=frozenset(FUSIONS)), plan)
    assert plan.summary() == fusions
    found = Counter(next((key for key in misses if key[0] == m.pattern and key[1] in m.reason), (m.pattern, m.reason))
                    for m in plan.misses)
    assert found == misses
    assert relative_error(first_output(gm, inputs), expected) <= 1e-6
