"""DDP and FSDP2 with graphopt (graphopt/distributed.py): two processes on the gloo backend, each training its half
of a batch, end with the loss and LoRA gradients of one process training the whole batch; the report says what
the distributed set-up is. With Dynamo's DDP optimizer (torch._dynamo.config.optimize_ddp, its default) the step
arrives as one graph per gradient bucket and the report says fusions across the splits are lost and how to keep
one graph; with it off each rank finds the fusions one process finds, and so does FSDP2 (fully_shard per decoder
layer), over one graph per sharded module."""

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import graphopt
from conftest import PLAN_SCHEMA
from graphs import relative_error
from models import tiny_lora_model

WORLD = 2
STEPS = 3
IDS = torch.randint(0, 128, (2 * WORLD, 16), generator=torch.Generator().manual_seed(0))
# Wide enough that the adapters' gradients (~1.5 MiB) fill more than one of DDP's 1 MiB buckets
WIDE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4)
TIMEOUT_S = 600  # a hang fails the test instead of holding CI


def train(forward, model, ids):
    """The losses of STEPS SGD steps and the adapters' gradients of the last."""
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


def worker(rank, init, engine, out):
    torch.set_num_threads(1)
    torch._dynamo.config.optimize_ddp = engine == "ddp_optimizer"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        model = tiny_lora_model("llama", **WIDE)
        if engine == "fsdp2":
            for layer in model.get_base_model().model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        else:
            wrapped = DistributedDataParallel(model, bucket_cap_mb=1)
        losses, grads = train(torch.compile(wrapped, backend="graphopt"), model, IDS[rank * 2:(rank + 1) * 2])
        grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}  # FSDP2's shards
        torch.save({"losses": losses, "grads": grads, "plans": [p.to_json() for p in graphopt.reports()],
                    "text": graphopt.last_report().to_text()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run_ranks(engine):
    """What each rank saved: its losses, gradients, plans and last report's text."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank")
        context = mp.start_processes(worker, args=(f"file://{os.path.join(folder, 'init')}", engine, out),
                                     nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # True once every rank ended
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {WORLD} DDP processes did not finish within {TIMEOUT_S} s")
        return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def one_process():
    """One process training the whole batch: the losses, gradients and fusions the ranks must match."""
    torch._dynamo.reset()
    model = tiny_lora_model("llama", **WIDE)
    losses, grads = train(torch.compile(model, backend="graphopt"), model, IDS)
    return losses, grads, graphopt.last_report().summary()


@pytest.mark.parametrize("engine", ["ddp_optimizer", "ddp_one_graph", "fsdp2"])
def test_several_processes_train_as_one_and_say_how(engine, one_process):
    losses, grads, fusions = one_process
    ranks = run_ranks(engine)
    # each rank's loss is the mean over its half; DDP and FSDP2 average the gradients: both are the whole batch's
    assert relative_error(sum(r["losses"] for r in ranks) / WORLD, losses) <= 1e-5
    for rank in ranks:
        assert all(relative_error(rank["grads"][n], grads[n]) <= 1e-5 for n in grads)
        for plan in rank["plans"]:
            PLAN_SCHEMA.validate(plan)
        setups = [plan["distributed"] for plan in rank["plans"]]
        assert all(s["world_size"] == WORLD and s["backend"] == "gloo" for s in setups)
        assert all(s["engine"] == ("FSDP2" if engine == "fsdp2" else "DDP") for s in setups)
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
        else:  # FSDP2's hooks run between graphs: one per sharded layer, the fusions all found
            assert len(rank["plans"]) > WIDE["num_hidden_layers"] and found == fusions
            assert "FSDP2" in rank["text"]
