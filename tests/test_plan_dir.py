"""Offline optimize-and-save (graphopt/plan_dir.py): graphopt.optimize writes a plan directory; a later process
compiling the same model with options={"plan": DIR} gets the same fusions and decisions, its graphs from the saved
compiled files, and trains to the same numbers; a directory made for another graphopt, torch, device or model, or
changed since it was written, is refused with what differs and how to fix it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import graphopt
from graphopt.options import OptionError
from graphopt.passes.registry import FUSIONS
from models import tiny_lora_model

TESTS = Path(__file__).parent
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def one_layer(arch="llama"):
    """The tiny model with one decoder layer: compiles are this module's time."""
    return tiny_lora_model(arch, num_hidden_layers=1)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    with fresh_cache():
        graphopt.optimize(one_layer(), {"input_ids": IDS, "labels": IDS}, out)
    return out


def train(model, options, steps=2):
    """Losses of a few SGD steps of model compiled with options, and its adapters after them."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options=options)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for _ in range(steps):
        loss = compiled(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


LATER_PROCESS = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import test_plan_dir
from torch._dynamo.utils import counters
import graphopt
model = test_plan_dir.one_layer()
losses, adapters = test_plan_dir.train(model, {{"plan": {plan!r}}})
torch.save(adapters, {adapters!r})
print(json.dumps({{"losses": losses, "inductor": dict(counters["inductor"]),
                   "notes": graphopt.last_report().notes}}))
"""


def test_optimize_writes_the_plan_directory(plan_dir):
    names = {p.name for p in plan_dir.iterdir()}
    assert names == {"plan.json", "report.txt", "report.json", "report.html", "compiled.tar", "manifest.json"}
    saved = json.loads((plan_dir / "plan.json").read_text())
    assert saved["schema"] == "graphopt.plan-dir/1"
    assert saved["versions"]["torch"] == torch.__version__ and saved["versions"]["graphopt"] == graphopt.__version__
    assert saved["model"]["class"] == "PeftModel" and saved["model"]["config"]["hidden_size"] == 64
    assert saved["inputs"]["input_ids"].startswith("int64[2, 16]")
    [graph] = saved["graphs"]
    assert graph["schema"] == "graphopt.plan/1" and graph["saved_for_backward"]["memory_budget"] == 1.0
    assert {"rms_norm", "rope", "swiglu", "lora", "linear_cross_entropy"} <= {f["pattern"] for f in graph["fusions"]}
    assert "fusions (" in (plan_dir / "report.txt").read_text()
    manifest = json.loads((plan_dir / "manifest.json").read_text())
    assert manifest["compiled.tar"] == hashlib.sha256((plan_dir / "compiled.tar").read_bytes()).hexdigest()
    assert (plan_dir / "compiled.tar").stat().st_size > 0


def test_optimize_leaves_the_model_as_it_was(tmp_path):
    model = one_layer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.random.get_rng_state()
    graphopt.optimize(model, {"input_ids": IDS, "labels": IDS}, tmp_path / "plan")
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_a_later_process_trains_from_the_plan_as_a_cold_compile_does(plan_dir, tmp_path):
    """A fresh process with an empty Inductor cache: both graphs come from the plan's compiled files, and the losses and
    adapters after two steps equal a cold compile's."""
    cold_losses, cold_adapters = train(one_layer(), {})
    script = LATER_PROCESS.format(tests=str(TESTS), plan=str(plan_dir), adapters=str(tmp_path / "adapters.pt"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=TESTS,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    later = json.loads(done.stdout.strip().splitlines()[-1])
    assert later["inductor"].get("fxgraph_cache_hit") == 2 and not later["inductor"].get("fxgraph_cache_miss")
    assert any("without a search" in note for note in later["notes"])
    assert later["losses"] == pytest.approx(cold_losses, rel=1e-6)
    adapters = torch.load(tmp_path / "adapters.pt")
    for name, value in cold_adapters.items():
        torch.testing.assert_close(adapters[name], value, rtol=1e-5, atol=1e-7)


def test_the_plan_gives_the_same_fusions_and_decisions(plan_dir, fresh_dynamo):
    """The fusions found again and checked; the partitioned graphs served by AOTAutograd's cache, which the plan
    directory holds, so the partitioner does not run and the decision is the saved one."""
    saved = graphopt.Plan.from_json(json.loads((plan_dir / "plan.json").read_text())["graphs"][0])
    served = torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]
    with fresh_cache():
        train(one_layer(), {"plan": str(plan_dir)}, steps=1)
    plan = graphopt.last_report()
    assert [(r.pattern, r.key) for r in plan.fusions] == [(r.pattern, r.key) for r in saved.fusions]
    assert torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] == served + 1
    assert plan.saved_for_backward == saved.saved_for_backward
    assert plan.options["plan"] == str(plan_dir.resolve())


def test_another_batch_shape_compiles_anew_with_the_plans_options(plan_dir, fresh_dynamo):
    model = one_layer()
    ids = IDS[:1]
    torch.compile(model, backend="graphopt", options={"plan": str(plan_dir)})(input_ids=ids, labels=ids)
    assert any("compiled anew" in note for note in graphopt.last_report().notes)


def copy_with(plan_dir, tmp_path, edit):
    """A copy of the plan directory with plan.json edited by edit(saved), and the manifest written to match."""
    copy = tmp_path / "copy"
    shutil.copytree(plan_dir, copy)
    saved = json.loads((copy / "plan.json").read_text())
    edit(saved)
    (copy / "plan.json").write_text(json.dumps(saved))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["plan.json"] = hashlib.sha256((copy / "plan.json").read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def compile_with(path, arch="llama"):
    torch._dynamo.reset()
    model = one_layer(arch)
    try:
        torch.compile(model, backend="graphopt", options={"plan": str(path)})(input_ids=IDS, labels=IDS)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("edit,message", [
    (lambda s: s["versions"].update(torch="2.0.0"), r"made with torch 2\.0\.0, and this is"),
    (lambda s: s["versions"].update(graphopt="0.0.1"), r"made with graphopt 0\.0\.1"),
    (lambda s: s["versions"].update(graphopt_code="0" * 16), r"made with graphopt's code 0{16}"),
    (lambda s: s["device"].update(target="cuda", name="NVIDIA H200", arch="sm_90"), r"made on NVIDIA H200"),
])
def test_a_plan_for_another_setup_is_refused(plan_dir, tmp_path, edit, message):
    with pytest.raises(Exception, match=message) as error:
        compile_with(copy_with(plan_dir, tmp_path, edit))
    assert "graphopt.optimize" in str(error.value)


def test_a_plan_for_another_model_is_refused(plan_dir, tmp_path):
    with pytest.raises(Exception, match="made for another model"):
        compile_with(plan_dir, arch="qwen2")


@pytest.mark.parametrize("name", ["compiled.tar", "plan.json"])
def test_a_changed_file_is_refused(plan_dir, tmp_path, name):
    copy = tmp_path / "copy"
    shutil.copytree(plan_dir, copy)
    data = bytearray((copy / name).read_bytes())
    data[len(data) // 2] ^= 1
    (copy / name).write_bytes(bytes(data))
    with pytest.raises(Exception, match=f"{name} does not match the SHA-256 of manifest.json"):
        compile_with(copy)


@pytest.mark.parametrize("raw,message", [
    ({"plan": "/no/such/dir"}, "no plan.json and manifest.json there"),
    ({"plan": ".", "memory_budget": 0}, "brings its own memory_budget"),
    ({"plan": ".", "fusions": ["lora"], "offload": True}, "brings its own fusions, offload: leave them out"),
])
def test_plan_option_errors(raw, message, plan_dir):
    raw = {k: (str(plan_dir) if v == "." else v) for k, v in raw.items()}
    with pytest.raises(OptionError, match=message):
        graphopt.options.parse_options(raw, FUSIONS)


def test_optimize_refuses_a_directory_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files and no plan"):
        graphopt.optimize(one_layer(), {"input_ids": IDS}, tmp_path)


def test_the_command_line_optimizes_a_config_directory(tmp_path):
    """`graphopt optimize DIR` where DIR holds a config.json alone: the model is built with random weights, LoRA
    r=16 on its projections, and the plan directory written."""
    import transformers

    from models import COMMON

    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path / "model")
    done = subprocess.run([sys.executable, "-m", "graphopt", "optimize", str(tmp_path / "model"), "--out",
                           str(tmp_path / "plan"), "--batch", "2", "--seq", "16", "--dtype", "fp32", "--device",
                           "cpu"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lora ×14" in done.stdout and "plan written to" in done.stdout
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert saved["inputs"]["input_ids"].startswith("int64[2, 16]")
    assert saved["model"]["config"]["hidden_size"] == COMMON["hidden_size"]


def test_a_factory_model_is_trained_as_it_is_or_given_lora():
    from graphopt.model_source import load_model

    as_it_is = load_model("models:tiny_llama", torch.float32, "cpu", lora_rank=0)
    assert hasattr(as_it_is, "peft_config") and as_it_is.peft_config["default"].r == 8
    based = load_model("models:tiny_llama_base", torch.float32, "cpu")
    assert based.peft_config["default"].r == 16
    with pytest.raises(SystemExit, match="neither an HF model directory"):
        load_model("no-such-thing", torch.float32, "cpu")


def test_a_plan_directory_written_again_is_read_again(tmp_path):
    """Within one process: optimize into a directory, compile with it, optimize into it again with other options;
    the next compile gets the new decisions."""
    model = one_layer()
    for budget in (1, 0):
        with fresh_cache():
            graphopt.optimize(model, {"input_ids": IDS, "labels": IDS}, tmp_path, {"memory_budget": budget})
            train(model, {"plan": str(tmp_path)}, steps=1)
        assert graphopt.last_report().saved_for_backward["memory_budget"] == budget


def test_triton_kernels_are_found_where_the_plan_unpacks_them(tmp_path, monkeypatch):
    """Triton's cache lists a kernel's files by absolute path in a group file; a plan directory's kernels, compiled
    in a folder since deleted, are found in this process's Triton cache once unpacked (else each compiles again)."""
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from graphopt import plan_dir

    made, here, key = tmp_path / "made", tmp_path / "here", "ABC"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(made / "triton"))
    saved = triton_cache.FileCacheManager(key)
    files = {name: saved.put(b"kernel", name) for name in ("k.json", "k.cubin")}
    saved.put_group("k.json", files)
    with tarfile.open(tmp_path / "compiled.tar", "w") as archive:
        archive.add(made, arcname=".")
    shutil.rmtree(made)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(here))
    plan_dir._unpack(tmp_path / "compiled.tar")
    found = triton_cache.FileCacheManager(key).get_group("k.json")
    assert found == {name: str(here / key / name) for name in files}
