"""DDP, FSDP2 and DeepSpeed ZeRO-2 with graphopt (graphopt/distributed.py): two processes on the gloo backend, each
training its half of a batch, end with the loss and LoRA gradients (ZeRO-2: the LoRA weights, its gradients being
partitioned) of one process training the whole batch; the report says what the distributed set-up is. With
Dynamo's DDP optimizer (torch._dynamo.config.optimize_ddp, its default) the step arrives as one graph per gradient
bucket and the report says fusions across the splits are lost and how to keep one graph; with it off each rank
finds the fusions one process finds, and so does FSDP2 (fully_shard per decoder layer), over one graph per sharded
module, and ZeRO-2 (engine.compile), over one graph. HF Trainer with a DeepSpeed ZeRO-2 config, optimizer offload
off and on, logs the uncompiled Trainer's losses and gradient norms. QLoRA under FSDP2 trains as one process, its
LoRA fused where the 4-bit weights are kept whole (ignored_params)."""

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import transformers
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import graphopt
from conftest import PLAN_SCHEMA
from graphs import relative_error
from models import tiny_lora_model
from test_qlora import loss_and_grads, qlora_model
from texts import VOCAB, pad_batch, sentences

WORLD = 2
STEPS = 3
IDS = torch.randint(0, 128, (2 * WORLD, 16), generator=torch.Generator().manual_seed(0))
# Wide enough that the adapters' gradients (~1.5 MiB) fill more than one of DDP's 1 MiB buckets
WIDE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4)
TIMEOUT_S = 600  # a hang fails the test instead of holding CI


def train(forward, model, ids):
    """The losses of STEPS SGD steps and the adapters' gradients of the last (the weights then have had STEPS - 1
    updates)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    losses = []
    for step in range(STEPS):
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        if step < STEPS - 1:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), grads


def train_zero2(model, ids):
    """train's steps through DeepSpeed's engine (ZeRO stage 2, SGD, no clipping): the losses, and no gradients
    (ZeRO-2 keeps each rank's partition of them in its own buffers)."""
    import deepspeed

    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trained, lr=0.01), config={
        "train_micro_batch_size_per_gpu": len(ids), "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20},
        "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**31})
    engine.compile(backend="graphopt")
    losses = []
    for step in range(STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if step < STEPS - 1:
            engine.step()
        losses.append(loss.detach())
    return torch.stack(losses), {}


def worker(rank, init, engine, out):
    torch.set_num_threads(1)
    torch._dynamo.config.optimize_ddp = engine == "ddp_optimizer"
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # as a launcher sets them
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        model = tiny_lora_model("llama", **WIDE)
        ids = IDS[rank * 2:(rank + 1) * 2]
        if engine == "zero2":
            losses, grads = train_zero2(model, ids)
        elif engine == "fsdp2":
            for layer in model.get_base_model().model.layers:
                fully_shard(layer)
            losses, grads = train(torch.compile(fully_shard(model), backend="graphopt"), model, ids)
        else:
            wrapped = DistributedDataParallel(model, bucket_cap_mb=1)
            losses, grads = train(torch.compile(wrapped, backend="graphopt"), model, ids)
        grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}  # FSDP2's shards
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        weights = {n: w.full_tensor() if isinstance(w, DTensor) else w for n, w in weights.items()}
        torch.save({"losses": losses, "grads": grads, "weights": weights,
                    "plans": [p.to_json() for p in graphopt.reports()],
                    "text": graphopt.last_report().to_text()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def spawn(target, *args):
    """Run target(rank, init, *args, out) in WORLD processes; what each rank saved to out."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank")
        context = mp.start_processes(target, args=(f"file://{os.path.join(folder, 'init')}", *args, out),
                                     nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # True once every rank ended
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {WORLD} processes of {target.__name__}{args} did not finish within {TIMEOUT_S} s")
        return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


def run_ranks(engine):
    """What each rank saved: its losses, gradients, weights, plans and last report's text."""
    return spawn(worker, engine)


@pytest.fixture(scope="module")
def one_process():
    """One process training the whole batch: the losses, gradients, weights and fusions the ranks must match."""
    torch._dynamo.reset()
    model = tiny_lora_model("llama", **WIDE)
    losses, grads = train(torch.compile(model, backend="graphopt"), model, IDS)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, grads, weights, graphopt.last_report().summary()


ENGINES = {"ddp_optimizer": "DDP", "ddp_one_graph": "DDP", "fsdp2": "FSDP2", "zero2": "DeepSpeed ZeRO-1/2"}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_several_processes_train_as_one_and_say_how(engine, one_process):
    losses, grads, weights, fusions = one_process
    ranks = run_ranks(engine)
    # each rank's loss is the mean over its half; the engines average the gradients: both are the whole batch's
    assert relative_error(sum(r["losses"] for r in ranks) / WORLD, losses) <= 1e-5
    for rank in ranks:
        assert all(relative_error(rank["grads"][n], grads[n]) <= 1e-5 for n in rank["grads"])
        assert all(relative_error(rank["weights"][n], weights[n]) <= 1e-5 for n in weights)
        for plan in rank["plans"]:
            PLAN_SCHEMA.validate(plan)
        setups = [plan["distributed"] for plan in rank["plans"]]
        assert all(s["world_size"] == WORLD and s["backend"] == "gloo" for s in setups)
        assert all(s["engine"] == ENGINES[engine] for s in setups)
        found = {}
        for plan in rank["plans"]:
            for record in plan["fusions"]:
                found[record["pattern"]] = found.get(record["pattern"], 0) + 1
        if engine == "ddp_optimizer":  # one graph per bucket, each saying so
            assert len(rank["plans"]) > 1 and all(s["split"] == 2**20 for s in setups)
            assert "one graph per gradient bucket" in rank["text"] and "optimize_ddp = False" in rank["text"]
            assert found["rms_norm"] == fusions["rms_norm"]  # no adapter inside a norm, so no split cuts one
        elif engine == "ddp_one_graph":
            assert len(rank["plans"]) == 1 and setups[0]["split"] is None and found == fusions
            assert "the step one graph" in rank["text"]
        elif engine == "fsdp2":  # FSDP2's hooks run between graphs: one per sharded layer, the fusions all found
            assert len(rank["plans"]) > WIDE["num_hidden_layers"] and found == fusions
            assert "FSDP2" in rank["text"]
        else:  # ZeRO-2's hooks run as the backward hands each gradient over: one graph
            assert len(rank["plans"]) == 1 and found == fusions and "DeepSpeed ZeRO-1/2" in rank["text"]


def trainer_worker(rank, init, compiled, offload, out):
    """HF Trainer with a DeepSpeed ZeRO-2 config (its optimizer's state in host memory with offload): the model
    compiled in place before the Trainer gets it, as README says for one process."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        model = tiny_lora_model("llama", vocab_size=VOCAB)
        if compiled:
            model.compile(backend="graphopt")
        zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
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


@pytest.mark.parametrize("offload", [False, True], ids=["offload off", "optimizer offload"])
def test_hf_trainer_with_deepspeed_zero2_trains_as_uncompiled(offload):
    eager, compiled = (spawn(trainer_worker, c, offload) for c in (False, True))
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
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
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
