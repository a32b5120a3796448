"""DDP, FSDP2 and DeepSpeed ZeRO-2 with graphopt (graphopt/distributed.py): two processes on the gloo backend, each
training its half of a batch, end with the loss and LoRA gradients (ZeRO-2: the LoRA weights, its gradients being
partitioned) of one process training the whole batch; the report says what the distributed set-up is. With
Dynamo's DDP optimizer (torch._dynamo.config.optimize_ddp, its default) the step arrives as one graph per gradient
bucket and the report says fusions across the splits are lost and how to keep one graph; with it off each rank
finds the fusions one process finds, and so does FSDP2 (fully_shard per decoder layer), over one graph per sharded
module, and ZeRO-2 (engine.compile), over one graph. HF Trainer under DeepSpeed and QLoRA under FSDP2:
tests/test_distributed_trainers.py."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import graphopt
from conftest import PLAN_SCHEMA
from graphs import relative_error
from models import COMMON, tiny_lora_model
from ranks import IDS, WORLD, init_rank, spawn

STEPS = 3
# Wide enough that the adapters' gradients (1.4 MiB over the 2 layers) fill more than one of DDP's 1 MiB buckets
# (the least bucket Dynamo's DDP optimizer accepts: its first is 1 MiB)
WIDE = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4)


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
    init_rank(rank, init)
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
            assert len(rank["plans"]) > COMMON["num_hidden_layers"] and found == fusions
            assert "FSDP2" in rank["text"]
        else:  # ZeRO-2's hooks run as the backward hands each gradient over: one graph
            assert len(rank["plans"]) == 1 and found == fusions and "DeepSpeed ZeRO-1/2" in rank["text"]
