"""The distributed set-up a graph compiles in, for the plan (and so the report) and the doctor.

graphopt adds no distribution of its own: DDP, FSDP2 and DeepSpeed run around the compiled graphs as they do
around any other. What the plan records is what changes graphopt's view of the step: how many processes train,
over which process-group backend, inside DDP, FSDP2 or DeepSpeed's ZeRO, and whether Dynamo's DDP optimizer split
the step into several graphs.

DeepSpeed's ZeRO stages 1 and 2 (`engine.compile(backend="graphopt")`) keep the step one graph: their hooks
reduce each gradient as the compiled backward hands it to autograd, outside the graph. They are told by the
attribute ZeRO's optimizer sets on every parameter it trains; ZeRO-3's parameters carry their own (`ds_id`).

DDP's optimizer (torch._dynamo.config.optimize_ddp, on by default) cuts the captured step at the boundaries of
DDP's gradient buckets, so that each bucket's all-reduce starts while the backward of the graphs before it runs.
Each piece reaches graphopt as a graph of its own: a fusion whose nodes straddle a cut is lost, and the memory
plan is made piece by piece. A LoRA step all-reduces only the adapters' gradients (a few MB to a few hundred MB,
about a millisecond over NVLink), so the overlap buys little and one graph is worth more; the report says so where
it finds the split.
"""

import os
import sys
from typing import Optional

import torch

SPLIT_ADVICE = ("set torch._dynamo.config.optimize_ddp = False before the first step to keep the step one graph: "
                "DDP then all-reduces the gradients after the backward, which for LoRA's adapters costs little")


def setup(example_inputs=()) -> Optional[dict]:
    """{"world_size", "rank", "backend", "engine", "split"} while a default process group exists, else None.
    engine: "DDP" inside a DistributedDataParallel forward, "FSDP2" where fully_shard has sharded modules of this
    process, "DeepSpeed ZeRO-1/2" or "DeepSpeed ZeRO-3" where the graph's parameters (among example_inputs) are
    ZeRO's, else None (a loop of one's own); split: the bucket size in bytes where DDP's optimizer splits this step
    into graphs, else None."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    splits = ddp is not None and torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"
    engine = "DDP" if ddp is not None else "FSDP2" if _fsdp2_in_use() else _zero_stage(example_inputs)
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


def _zero_stage(example_inputs) -> Optional[str]:
    """Which ZeRO stage of DeepSpeed trains the graph's parameters, None where DeepSpeed is not imported or owns
    none of them. ZeRO-1 and ZeRO-2 share their optimizer and its mark (param_idx_in_group), so they are one
    answer."""
    if "deepspeed" not in sys.modules:
        return None
    parameters = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
    if any(hasattr(p, "ds_id") for p in parameters):
        return "DeepSpeed ZeRO-3"
    if any(hasattr(p, "param_idx_in_group") for p in parameters):
        return "DeepSpeed ZeRO-1/2"
    return None


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
        return line + ", neither DDP, FSDP2 nor DeepSpeed's ZeRO (a loop of one's own)"
    if setup["engine"] == "DeepSpeed ZeRO-1/2":
        return line + (", DeepSpeed ZeRO-1/2: its hooks reduce the gradients as the backward hands them over, the "
                       "step one graph")
    if setup["engine"] == "DeepSpeed ZeRO-3":
        return line + ", DeepSpeed ZeRO-3: its hooks gather the parameters between graphs (not tested with graphopt)"
    if setup["engine"] == "FSDP2":
        return line + ", FSDP2: its hooks gather and scatter between graphs (one graph per sharded module)"
    if setup["split"] is None:
        return line + ", DDP, the step one graph (torch._dynamo.config.optimize_ddp off)"
    return (line + f", DDP: its optimizer splits the step into one graph per gradient bucket of "
            f"{setup['split'] / 2**20:g} MiB, this graph one of them: fusions across a split are lost")
