"""The MODEL argument of the command line (`graphopt optimize MODEL`, `graphopt explain MODEL`): an HF model
directory, or `module:factory`; the arguments both commands share, and the training step both compile.

An HF directory with weights loads them; with a config.json alone the model is built from it with random
weights (the plan depends on shapes, not values). On the meta device (`graphopt explain`) nothing is loaded or
allocated: shapes and dtypes only. A base model gets PEFT LoRA, r=16 on the usual projections,
unless told otherwise; a factory returns the model as it is to be trained (PEFT or not).
"""

import contextlib
import importlib
from pathlib import Path

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(parser) -> None:
    """MODEL and the batch it is compiled for, its dtype, LoRA and graphopt's options."""
    parser.add_argument("model", help="an HF model directory (a config.json alone builds it with random weights), "
                                      "or module:factory")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="LoRA rank on the usual projections of a model without adapters (0: as it is)")
    parser.add_argument("--options", default="{}", help="graphopt's options as JSON, e.g. '{\"memory_budget\": 0}'")


def training_step(forward, inputs: dict) -> None:
    """The step optimize and explain compile: the forward on inputs, then the backward of its loss when it has
    one that needs gradients (an inference model compiles its forward alone)."""
    outputs = forward(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) and "loss" in outputs else None
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()


def load_model(source: str, dtype: torch.dtype, device: str, lora_rank: int = 16) -> torch.nn.Module:
    path, meta = Path(source), device == "meta"
    with torch.device("meta") if meta else contextlib.nullcontext():
        if path.is_dir():
            model = _from_directory(path, dtype, weights=not meta)
        elif ":" in source:
            module, _, name = source.partition(":")
            model = getattr(importlib.import_module(module), name)()
            if not hasattr(model, "peft_config"):  # a base model in the dtype asked for; adapters as they come
                model = model.to(dtype)
        else:
            raise SystemExit(f"MODEL {source!r}: neither an HF model directory (with a config.json) nor "
                             f"module:factory")
    model = model.to(device)
    if lora_rank and not hasattr(model, "peft_config"):
        import peft

        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        targets = [t for t in LORA_TARGETS if t in present] or "all-linear"
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                           target_modules=targets))
    return model


def _from_directory(path: Path, dtype: torch.dtype, weights: bool) -> torch.nn.Module:
    import transformers

    if not (path / "config.json").is_file():
        raise SystemExit(f"MODEL {str(path)!r}: no config.json there")
    if weights and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    config = transformers.AutoConfig.from_pretrained(path)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def example_inputs(model: torch.nn.Module, batch: int, seq: int, device: str) -> dict:
    """input_ids and labels of batch × seq random tokens of the model's vocabulary."""
    vocab = model.config.vocab_size if hasattr(model, "config") else 128
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "labels": ids}
