"""Where offload's time goes: 1B train steps with graphopt's options from $OPTS, timed (3 steps after 3 warm-up),
then 2 profiled: host↔device copies, graphopt's transfer ops and any blocking runtime calls, per step.
    OPTS='{"memory_budget": 0, "offload": true}' python benchmarks/offload_profile.py   (CUDA only)
"""
import sys, os, time, torch
sys.path.insert(0, "benchmarks")
import train_step
from torch.profiler import profile, ProfilerActivity
args = train_step.parse_args(["--variant", "graphopt", "--options", os.environ["OPTS"]])
device = torch.device("cuda")
model, forward, _ = train_step.prepare(args, device, torch.bfloat16)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, 128256, (4, 2048), device=device)
for _ in range(3):
    train_step.train_step(forward, opt, ids)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(3):
    train_step.train_step(forward, opt, ids)
torch.cuda.synchronize(); print(os.environ["OPTS"], f"{(time.perf_counter() - t) / 3 * 1000:.1f} ms/step")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        train_step.train_step(forward, opt, ids)
    torch.cuda.synchronize()
for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total):
    k = e.key.lower()
    if any(s in k for s in ("synchronize", "hostalloc", "malloc", "cudafree", "memcpy", "graphopt::offload",
                            "graphopt::reload", "eventsync", "streamwait")):
        print(f"  {e.key[:60]:<60} count {e.count // 2:>5} cpu {e.cpu_time_total / 2000:8.2f} ms/step  "
              f"device {e.device_time_total / 2000:8.2f} ms/step")
