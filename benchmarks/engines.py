"""The train step on several processes, one per GPU: DDP or FSDP2 around each variant's model (train_step.py
--engine), launched by torchrun:

    torchrun --nproc-per-node 2 benchmarks/train_step.py --variant graphopt --engine ddp --shape 8b --batch 2

Each rank trains batches of its own (the data seed offset by the rank) of --batch rows; rank 0 writes the result:
tokens/s of all ranks together over the slowest rank's time, peak memory of the rank that peaked highest (per GPU).
"""

import os

import torch
import torch.distributed as dist

ENGINES = ("none", "ddp", "fsdp2")
NAMES = {"ddp": "DDP", "fsdp2": "FSDP2"}  # as results tables name them


def launched() -> bool:
    """Whether this process is one of several that a launcher (torchrun, or a test) started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device) -> torch.device:
    """Joins the launcher's process group (NCCL on CUDA, gloo on the CPU) unless this process already has one;
    returns the device this rank trains on (its local GPU)."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def wrap(model, engine: str, dtype: torch.dtype, device: torch.device):
    """model inside the engine, as its users write it: DDP around the whole model; FSDP2 sharding each decoder
    layer and then the model, parameters gathered in dtype and gradients reduced in fp32. Returns what to call
    (and compile)."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    return model


def combined(value, how: str, device: torch.device):
    """value (a number, or None) over every rank: "sum", or "max"; as it is in one process."""
    if value is None or not dist.is_initialized():
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if how == "sum" else dist.ReduceOp.MAX)
    return tensor.item()


def finish():
    if dist.is_initialized():
        dist.destroy_process_group()
