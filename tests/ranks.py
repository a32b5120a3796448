"""Running a test's work in several processes, each a rank of one gloo process group (tests/test_distributed*.py)."""

import faulthandler
import os
import sys
import tempfile
import time

import pytest
import torch
import torch._inductor.config
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 600  # a hang fails the test instead of holding CI
# Two ranks' halves of one batch, each rank taking IDS[2 * rank:2 * rank + 2]
IDS = torch.randint(0, 128, (2 * WORLD, 16), generator=torch.Generator().manual_seed(0))


def init_rank(rank, init):
    """Join the process group as a launcher would set rank `rank` up. Inductor compiles in the rank's own process:
    its pool of compile workers is a known cause of distributed processes hanging at exit (PyTorch's own
    distributed Inductor tests turn it off the same way). Each rank prints its threads' stacks shortly before
    spawn's deadline, so a hang says where it is."""
    torch._inductor.config.compile_threads = 1
    faulthandler.dump_traceback_later(TIMEOUT_S - 30, exit=False)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)


def _rank(rank, target, *args):
    """target(rank, *args), then the process ends at once. The rank's work is done by then (its results saved, its
    process group destroyed); the interpreter's teardown, which frees DeepSpeed's and gloo's objects in no set
    order, can abort a rank (std::terminate, SIGABRT) after that, failing a test whose numbers are right. An
    exception still reaches spawn as the rank's error."""
    target(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(target, *args):
    """Run target(rank, init, *args, out) in WORLD processes; what each rank saved to out."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank")
        context = mp.start_processes(_rank, args=(target, f"file://{os.path.join(folder, 'init')}", *args, out),
                                     nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # True once every rank ended
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {WORLD} processes of {target.__name__}{args} did not finish within {TIMEOUT_S} s")
        return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
