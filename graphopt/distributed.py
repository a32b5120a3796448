"""The distributed set-up a graph compiles in, for the plan (and so the report) and the doctor.

graphopt adds no distribution of its own: DDP, FSDP2 and DeepSpeed run around the compiled graphs as they do
around any other. What the plan records is what changes graphopt's view of the step: how many processes train,
over which process-group backend, inside DDP or FSDP2, and whether Dynamo's DDP optimizer split the step into
several graphs.

DDP's optimizer (torch._dynamo.config.optimize_ddp, on by default) cuts the captured step at the boundaries of
DDP's gradient buckets, so that each bucket's all-reduce starts while the backward of the graphs before it runs.
Each piece reaches graphopt as a graph of its own: a fusion whose nodes straddle a cut is lost, and the memory
plan is made piece by piece. A LoRA step all-reduces only the adapters' gradients (a few MB to a few hundred MB,
about a millisecond over NVLink), so the overlap buys little and one graph is worth more; the report says so where
it finds the split.
"""

import os
from typing import Optional

import torch

SPLIT_ADVICE = ("set torch._dynamo.config.optimize_ddp = False before the first step to keep the step one graph: "
                "DDP then all-reduces the gradients after the backward, which for LoRA's adapters costs little")


def setup() -> Optional[dict]:
    """{"world_size", "rank", "backend", "engine", "split"} while a default process group exists, else None.
    engine: "DDP" inside a DistributedDataParallel forward, "FSDP2" where fully_shard has sharded modules of this
    process, else None (DeepSpeed or a loop of one's own: not told apart); split: the bucket size in bytes where
    DDP's optimizer splits this step into graphs, else None."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    splits = ddp is not None and torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"
    engine = "DDP" if ddp is not None else "FSDP2" if _fsdp2_in_use() else None
    return {"world_size": torch.distributed.get_world_size(), "rank": torch.distributed.get_rank(),
            "backend": str(torch.distributed.get_backend()), "engine": engine,
            "split": ddp.bucket_bytes_cap if splits else None}


def _fsdp2_in_use() -> bool:
    """Whether fully_shard has sharded a module in this process. A graph traced between FSDP2's hooks need not
    pass through a sharded module's own code (the root's embedding, its final norm and head), so the process's
    FSDP states are asked, not the graph."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return any(isinstance(state(), FSDPState) for state in list(_module_state_mapping.values()))


def describe(setup: Optional[dict]) -> str:
    """One line for the report's summary and the doctor."""
    if setup is None:
        world = os.environ.get("WORLD_SIZE", "1")  # set by torchrun and accelerate's launcher
        if world != "1":
            return (f"rank {os.environ.get('RANK', '?')} of {world} by the launcher's environment, no "
                    f"torch.distributed process group initialized yet")
        return "one process (no torch.distributed process group)"
    line = f"rank {setup['rank']} of {setup['world_size']} ({setup['backend']})"
    if setup["engine"] is None:
        return line + ", neither DDP nor FSDP2 (DeepSpeed or a loop of one's own: not told apart)"
    if setup["engine"] == "FSDP2":
        return line + ", FSDP2: its hooks gather and scatter between graphs (one graph per sharded module)"
    if setup["split"] is None:
        return line + ", DDP, the step one graph (torch._dynamo.config.optimize_ddp off)"
    return (line + f", DDP: its optimizer splits the step into one graph per gradient bucket of "
            f"{setup['split'] / 2**20:g} MiB, this graph one of them: fusions across a split are lost")
