"""HF Trainer with a graphopt-compiled model, the way users run it: `model.compile(backend="graphopt")` before
the Trainer gets it (README), batches padded to their own length, gradient accumulation (num_items_in_batch),
max_grad_norm, evaluation inside training, fp32 and bf16=True (autocast), a checkpoint saved and resumed. Per-step
loss and grad_norm, the eval losses and the final adapters equal the uncompiled Trainer's."""

import pytest
import torch
import transformers

import graphopt
from graphs import relative_error
from models import tiny_lora_model
from texts import VOCAB, pad_batch, sentences


# on the GPU: the same runs with the Triton lowering
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (bf16, device) of the Trainer runs: bf16=True on the GPU only; on the CPU, tests/test_trl.py's DPO test runs a
# Trainer under bf16 autocast
PRECISIONS = [pytest.param(False, "cpu", id="fp32-cpu")] + [
    pytest.param(bf16, "cuda", id=f"{'bf16=True' if bf16 else 'fp32'}-cuda") for bf16 in (False, True)
    if "cuda" in DEVICES]


def train(tmp_path, compiled: bool, bf16: bool, steps=6, resume=None, save_steps=3, device="cpu"):
    """(log history, final adapters, reports compiled) of a Trainer run on the demo text. One decoder layer: the
    compiles are the test's time."""
    model = tiny_lora_model("llama", vocab_size=VOCAB, num_hidden_layers=1)
    torch._dynamo.reset()
    before = len(graphopt.reports())
    if compiled:
        model.compile(backend="graphopt")  # in place: the Trainer still sees the PeftModel's forward signature
    data = sentences()[:20]  # whole batches of 4: a last batch of one would compile once more (Dynamo specializes 1)
    args = transformers.TrainingArguments(
        str(tmp_path / ("compiled" if compiled else "eager")), use_cpu=device == "cpu", bf16=bf16, seed=0, data_seed=0,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=steps, learning_rate=2e-3,
        max_grad_norm=1.0, logging_steps=1, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4,
        save_steps=save_steps, report_to=[], disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8],
                                   data_collator=pad_batch)
    trainer.train(resume_from_checkpoint=resume)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer.state.log_history, adapters, graphopt.reports()[before:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train(folder, compiled, bf16, device), each run once per module: the resume test resumes the compiled fp32
    run that the comparison with the uncompiled Trainer checked. Returns what train does and the run's folder."""
    runs = {}

    def run(compiled: bool, bf16: bool, device: str):
        if (compiled, bf16, device) not in runs:
            folder = tmp_path_factory.mktemp("trainer")
            runs[compiled, bf16, device] = (*train(folder, compiled, bf16, device=device), folder)
        return runs[compiled, bf16, device]

    return run


def logged(history, key):
    return [entry[key] for entry in history if key in entry]


@pytest.mark.parametrize("bf16, device", PRECISIONS)
def test_trainer_matches_the_uncompiled_trainer(trained, bf16, device):
    eager_history, eager_adapters, _, _ = trained(False, bf16, device)
    history, adapters, reports, _ = trained(True, bf16, device)
    # Liger's convergence tolerances in bf16; fp32 as every other fp32 comparison
    close = (dict(rel=5e-2, abs=1e-2) if bf16 else dict(rel=1e-5))
    for key in ("loss", "grad_norm", "eval_loss"):
        assert len(logged(history, key)) == len(logged(eager_history, key)) > 0, key
        assert logged(history, key) == pytest.approx(logged(eager_history, key), **close), key
    for name, weight in adapters.items():
        assert relative_error(weight, eager_adapters[name]) <= (5e-2 if bf16 else 1e-5), name
    # batches of several lengths: the first size compiles static, the next one dynamic (then reused); evaluation
    # (no gradients, logits returned) compiles once more
    assert len(reports) == 3
    training = [r for r in reports if "linear_cross_entropy" in r.summary()]
    assert len(training) == 2
    for report in reports:
        assert report.summary()["lora"] == 7 and report.summary()["rms_norm"] == 3
        # named from the model, also when accelerate wraps the forward (bf16=True) and that wrapper is compiled
        assert all(r.module.startswith("base_model.model.") for r in report.fusions), [r.module for r in report.fusions]
        # the only misses: a padding mask is not provably causal, so SDPA keeps it (and k/v stay repeated)
        assert {m.pattern for m in report.misses} <= {"attention_causal", "attention_gqa", "linear_cross_entropy"}


def test_trainer_resumes_from_a_checkpoint(trained, tmp_path):
    """A second Trainer resumes the compiled run from its step-3 checkpoint and ends where the run itself did."""
    straight_history, straight, _, folder = trained(True, False, "cpu")
    history, resumed, _ = train(tmp_path, compiled=True, bf16=False, resume=str(folder / "compiled" / "checkpoint-3"))
    after = [(e["step"], e["loss"]) for e in history if "loss" in e and e["step"] > 3]
    assert [step for step, _ in after] == [4, 5, 6]
    assert [loss for _, loss in after] == pytest.approx(logged(straight_history, "loss")[3:], rel=1e-5)
    for name, weight in resumed.items():
        assert relative_error(weight, straight[name]) <= 1e-5, name
