"""Training through graphopt follows eager step for step: 30 AdamW steps, every fusion on (fp32)."""

import pytest
import torch

import graphopt
from models import tiny_lora_model


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_thirty_adamw_steps_track_eager(arch):
    # lr 3e-3: at 1e-2 fp32 rounding alone is amplified past 1e-4 within 30 steps (plain inductor drifts 1.2e-3
    # from eager there too); at 3e-3 graphopt stays within 3e-6 of eager and the loss still falls by ~0.4.
    eager, twin = tiny_lora_model(arch), tiny_lora_model(arch)  # same seed: the same weights
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="graphopt")
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3) for m in (eager, twin)]
    # Two batches in turn: random tokens carry nothing to learn unless they repeat.
    batches = torch.randint(0, 128, (2, 4, 24), generator=torch.Generator().manual_seed(3)).repeat(15, 1, 1)
    losses = {"eager": [], "graphopt": []}
    for ids in batches:
        for name, model, optimizer in (("eager", eager, optimizers[0]), ("graphopt", compiled, optimizers[1])):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    for step, (a, b) in enumerate(zip(losses["eager"], losses["graphopt"])):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: eager {a}, graphopt {b}"
    assert losses["eager"][-1] < losses["eager"][0] - 0.1  # it learned: the comparison is not of a flat line
    summary = graphopt.last_report().summary()
    assert summary["rms_norm"] == 5 and summary["lora"] == 14
