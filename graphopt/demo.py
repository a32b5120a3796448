"""The demo: LoRA fine-tuning of a tiny Llama-style model through torch.compile(backend="graphopt").

A byte-level model (vocab 256, random base weights) learns the text in graphopt/data/demo.txt with
PEFT LoRA adapters on every projection; the loss falls over a few dozen AdamW steps, then the fusion
report is printed. Runs on the GPU when there is one, else on the CPU. With --trainer the same fine-tune runs
through transformers.Trainer with bf16=True (fp32 weights under bf16 autocast), on packed batches of the text's
lines, the model compiled in place first: the one line graphopt asks of a Trainer user.
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers

TEXT = Path(__file__).parent / "data" / "demo.txt"


def tiny_llama(device: torch.device, dtype: torch.dtype):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        # The base stays frozen: at HF's default 0.02 its tied embeddings keep every logit near 0, and the
        # adapters alone could not make the next byte sharply likelier. 0.1 leaves them room to learn.
        initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(model, lora)


def batches(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq, (batch,), generator=generator)
        yield torch.stack([data[s:s + seq] for s in starts])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--report", default=None, help="also write the report to this .txt/.json/.html path")
    parser.add_argument("--trainer", action="store_true",
                        help="train through transformers.Trainer (bf16=True, packed batches) instead of a plain loop")
    args = parser.parse_args(argv)
    if args.trainer:
        return train_with_trainer(args)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    data = torch.tensor(list(TEXT.read_bytes()), dtype=torch.long)
    model = tiny_llama(device, dtype)
    model.print_trainable_parameters()
    options = {"report": args.report} if args.report else {}
    compiled = torch.compile(model, backend="graphopt", options=options)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    print(f"training on {device} ({dtype}), {args.steps} steps of {args.batch}×{args.seq} bytes")
    stream = batches(data, args.batch, args.seq, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = next(stream).to(device)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:3d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f} s)")

    import graphopt

    print()
    print(graphopt.last_report().to_text())


def train_with_trainer(args) -> None:
    """The fine-tune through HF's Trainer: model.compile(...) is the only line graphopt adds."""
    import graphopt

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = tiny_llama(device, torch.float32)  # fp32 weights: bf16=True runs the forward under bf16 autocast
    model.config.use_cache = False  # packed batches: HF keeps the documents apart only without a KV cache
    options = {"report": args.report} if args.report else {}
    # In place, not torch.compile(model): the Trainer reads the forward's signature (labels, input columns) from
    # the model it is given, and a compiled wrapper's signature is (*args, **kwargs).
    model.compile(backend="graphopt", options=options)
    lines = [{"input_ids": list(line.encode())} for line in TEXT.read_text().splitlines() if line.strip()]
    # save_strategy="no" writes nothing, but TrainingArguments still creates its output_dir: a temporary one
    # keeps the demo from leaving a folder where it runs.
    output_dir = tempfile.mkdtemp(prefix="graphopt-demo-")
    training = transformers.TrainingArguments(
        output_dir, bf16=True, use_cpu=device.type == "cpu", per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=args.lr, max_grad_norm=1.0,
        logging_steps=5, save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=lines,
                                   data_collator=transformers.DataCollatorWithFlattening())
    try:
        trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    print()
    print(graphopt.last_report().to_text())


if __name__ == "__main__":
    main()
