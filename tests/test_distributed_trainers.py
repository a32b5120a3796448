"""HF Trainer with a DeepSpeed ZeRO-2 config, and QLoRA under FSDP2, with graphopt: two processes on the gloo
backend. The Trainer, its optimizer's state offloaded to host memory, logs the uncompiled Trainer's losses and
gradient norms; QLoRA under FSDP2 trains as one process, its LoRA fused where the 4-bit weights are kept whole
(ignored_params). (DDP, FSDP2 and ZeRO-2 without offload on a hand-written loop: tests/test_distributed.py.)"""

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import graphopt
from graphs import relative_error
from models import tiny_lora_model
from ranks import IDS, WORLD, init_rank, spawn
from test_qlora import loss_and_grads, qlora_model
from texts import VOCAB, pad_batch, sentences


def trainer_worker(rank, init, compiled, out):
    """HF Trainer with a DeepSpeed ZeRO-2 config (its optimizer's state in host memory): the model compiled in
    place before the Trainer gets it, as README says for one process."""
    torch.set_num_threads(1)
    init_rank(rank, init)
    try:
        model = tiny_lora_model("llama", vocab_size=VOCAB, num_hidden_layers=1)  # its compiles are the test's time
        if compiled:
            model.compile(backend="graphopt")
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        # "auto": the Trainer's arguments fill them in; a torch optimizer stands in for DeepSpeed's CPU Adam,
        # which is a C++ build
        config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "zero_optimization": zero, "zero_allow_untested_optimizer": True,
                  "zero_force_ds_cpu_optimizer": False}
        args = transformers.TrainingArguments(
            f"{out}-trainer", deepspeed=config, seed=0, data_seed=0, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-3, max_grad_norm=1.0, logging_steps=1,
            save_strategy="no", report_to=[], disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=sentences()[:24], data_collator=pad_batch)
        trainer.train()
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save({"history": trainer.state.log_history, "adapters": adapters,
                    "plans": [p.to_json() for p in graphopt.reports()]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_hf_trainer_with_deepspeed_zero2_and_optimizer_offload_trains_as_uncompiled():
    eager, compiled = (spawn(trainer_worker, c) for c in (False, True))
    for key in ("loss", "grad_norm"):
        logged = [[entry[key] for entry in rank["history"] if key in entry] for rank in (eager[0], compiled[0])]
        assert len(logged[0]) == 3 and logged[1] == pytest.approx(logged[0], rel=1e-5), key
    for rank in compiled:
        assert all(relative_error(w, eager[0]["adapters"][n]) <= 1e-5 for n, w in rank["adapters"].items())
        assert rank["plans"] and all(p["distributed"]["engine"] == "DeepSpeed ZeRO-1/2" for p in rank["plans"])
        training = [p for p in rank["plans"] if any(f["pattern"] == "linear_cross_entropy" for f in p["fusions"])]
        assert training and all(not p["misses"] for p in training)


def qlora_fsdp2_worker(rank, init, ignore_4bit, out):
    """A QLoRA model (bitsandbytes NF4 base) under fully_shard per decoder layer, its 4-bit weights sharded or kept
    whole (ignored_params): the loss and adapters' gradients of one step, and the plans."""
    import bitsandbytes

    torch.set_num_threads(1)
    model = qlora_model("llama")  # loaded before the process group exists, as one process loads it
    init_rank(rank, init)
    try:
        ignored = {p for p in model.parameters() if isinstance(p, bitsandbytes.nn.Params4bit)} if ignore_4bit else None
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, ignored_params=ignored)
        fully_shard(model, ignored_params=ignored)
        ids = IDS[rank * 2:(rank + 1) * 2]
        loss, grads = loss_and_grads(model, ids, torch.compile(model, backend="graphopt"))
        grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
        torch.save({"loss": loss, "grads": grads, "plans": [p.to_json() for p in graphopt.reports()]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ignore_4bit", [True, False], ids=["4-bit weights whole", "4-bit weights sharded"])
def test_qlora_under_fsdp2_trains_as_one_process(ignore_4bit):
    """Whole on each rank (ignored_params), the 4-bit weights leave the step one graph per layer with every LoRA
    fused; sharded, Dynamo breaks each layer's graph at their .data swaps, the numbers stay right and every LoRA
    miss says how to keep them whole."""
    model = qlora_model("llama")
    loss, grads = loss_and_grads(model, IDS)
    ranks = spawn(qlora_fsdp2_worker, ignore_4bit)
    assert relative_error(sum(r["loss"] for r in ranks) / WORLD, loss) <= 1e-5
    layers = model.config.num_hidden_layers
    for rank in ranks:
        assert all(relative_error(rank["grads"][n], g) <= 1e-5 for n, g in grads.items())
        fused = sum(f["pattern"] == "lora_4bit" for plan in rank["plans"] for f in plan["fusions"])
        missed = [m["reason"] for plan in rank["plans"] for m in plan["misses"] if m["pattern"] == "lora"]
        if ignore_4bit:
            assert fused == 7 * layers and not missed
        else:
            assert fused == 0 and missed and all("ignored_params" in reason for reason in missed)
