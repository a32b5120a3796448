"""The analyses behind benchmarks/train_step.py's --profile (per-stream timeline; --profile-new-length's batch)
and --memory-at-peak (the allocator's history replayed), and the SFT batches of --data: the figures in
benchmarks/RESULTS.md come from them."""

import json
import math
import pathlib
import sys

import pytest
import torch

from ranks import init_rank, spawn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import train_step  # noqa: E402


def span(stream, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_stream_timeline_counts_overlaps_once_and_measures_gaps():
    events = [span(7, 0, 10), span(7, 5, 10),  # overlapping: busy 0..15
              span(7, 115, 5),  # a 100 µs gap before it
              span(13, 2, 50, "gpu_memcpy"), span(13, 60, 4, "gpu_memset")]
    timeline = train_step.stream_timeline(events)
    assert timeline[7] == (3, 20.0, 0, [100])
    assert timeline[13] == (2, 54.0, 54, [8])


def test_stream_timeline_is_printed_from_a_chrome_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [span(7, 0, 1000), span(7, 1500, 500), {"ph": "i", "ts": 0}]}))
    train_step.print_stream_timeline(str(trace), steps=1)
    assert "stream 7: 2 ops/step, busy 1.5 ms/step (copies 0.0), idle 0.5 ms/step in 1 gaps, 1 of them" in (
        capsys.readouterr().err)


def test_device_copies_are_counted_by_the_host_ops_that_made_them(tmp_path, capsys):
    """A device-to-device copy → its runtime call (the same correlation id) → the CPU ops enclosing that call on its
    thread, innermost first; copies of other kinds are not counted."""
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1, "args": {}}

    def copy(correlation, ts, name="Memcpy DtoD (Device -> Device)"):
        return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": ts, "dur": 2, "tid": 1,
                 "args": {"correlation": correlation}},
                {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts + 5, "dur": 20, "tid": 9,
                 "args": {"correlation": correlation, "stream": 7}}]

    events = [op("graph", 0, 1000), op("aten::addmm", 10, 100), op("aten::copy_", 20, 10),
              op("aten::addmm", 200, 100), op("aten::copy_", 210, 10), op("aten::clone", 400, 50),
              op("aten::copy_", 410, 10), *copy(1, 22), *copy(2, 212), *copy(3, 412),
              *copy(4, 600, "Memcpy HtoD (Pinned -> Device)")]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    train_step.print_device_copies(str(trace), steps=1)
    err = capsys.readouterr().err
    assert "0.04 ms/step ×2     aten::copy_ ← aten::addmm ← graph" in err
    assert "0.02 ms/step ×1     aten::copy_ ← aten::clone ← graph" in err
    assert "HtoD" not in err and err.count("ms/step") == 2


def test_a_result_line_names_the_hosts_link_where_it_was_measured():
    result = {"variant": "unsloth", "options": None, "shape": "1b", "batch": 4, "seq": 2048, "dtype": "bf16",
              "device_name": "NVIDIA H200", "tokens_per_s": 52976.0, "step_ms": 154.6, "peak_alloc_gib": 3.65,
              "peak_reserved_gib": 3.79, "cuda_graphs": False, "first_loss": 12.18, "loss": 11.80,
              "host_link_gib_s": {"d2h": 51.1, "h2d": 50.3}, "launch_us": 6.44}
    assert train_step.describe(result).endswith("; host: pinned copies 51 GiB/s to it, 50 back, 6.4 µs a launch")
    off_cuda = {**result, "host_link_gib_s": None, "launch_us": None}
    assert train_step.describe(off_cuda).endswith("loss 12.1800 -> 11.8000")
    # results recorded without the host probes, then with the link probe only
    older = {k: v for k, v in result.items() if k not in ("host_link_gib_s", "launch_us")}
    assert train_step.describe(older) == train_step.describe(off_cuda)
    link_only = {k: v for k, v in result.items() if k != "launch_us"}
    assert train_step.describe(link_only).endswith("; host: pinned copies 51 GiB/s to it, 50 back")


def event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_allocations_at_peak_replays_the_history():
    framed = [{"filename": "lowering/transfer.py", "line": 66, "name": "_copy_in"}]
    events = [
        event("alloc", 1, 100, framed),
        event("free_requested", 1, 100, framed),  # not freed yet: only free_completed counts
        event("alloc", 2, 50),  # no Python frames: placed after the last framed event
        event("free_completed", 99, 30, framed),  # allocated before the history began
        event("free_completed", 1, 100, framed),
        event("alloc", 3, 10, framed),
    ]
    peak, live = train_step.allocations_at_peak(events, start=1000)
    assert peak == 1150 and set(live) == {1, 2}
    assert live[2]["after"] is events[1]
    assert train_step.allocations_at_peak(events[:1], start=0) == (100, {1: events[0]})


def test_every_lora_sweep_case_runs_with_the_grids_keys(monkeypatch):
    """benchmarks/lora_configs.py times each kernel under the configs of its grid: every key of a grid entry must
    be one the launch functions accept (a stale one fails every config, which the sweep reports as 'cannot run').
    At a tiny shape, on the CPU through Triton's interpreter, under CUDA's launch settings."""
    import lora_configs
    from graphopt.kernels import layout, lora

    monkeypatch.setitem(lora_configs.SHAPES, "tiny", dict(tokens=64, hidden=32, kv=16, intermediate=48))
    monkeypatch.setattr(layout, "platform", lambda t: "cuda")
    monkeypatch.setattr(layout, "multiprocessors", lambda device: 2)
    monkeypatch.setitem(lora.PRECISION, "cuda", "ieee")  # the interpreter's dots
    for name, grid in lora_configs.GRIDS.items():  # compiled Triton rejects unknown keys; the interpreter does not
        assert all(config.keys() == lora.CONFIGS["cuda"][name].keys() for config in grid), name
    for name, calls in lora_configs.cases("tiny", device="cpu").items():
        monkeypatch.setitem(lora.CONFIGS["cuda"], name, lora_configs.GRIDS[name][0])
        for call, _ in calls:
            call()


def test_host_time_lists_the_cpu_events_by_self_time(capsys):
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            torch.mm(x, x)
            x.add(1)
    train_step.print_host_time(prof, steps=2)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("  host: ") and "ms/step of self time" in lines[0]
    listed = {line.split()[-1]: line for line in lines[1:]}
    assert "×1" in listed["aten::mm"] and "×1" in listed["aten::add"]  # counts per step


def test_sft_batches_padded_and_packed_hold_the_same_documents():
    """--data padded and packed: the same documents a step, padding masked in attention_mask and labels, packed
    positions restarting per document with its first label -100, lengths from the stated distribution."""
    padded, tokens = train_step.make_batches("padded", 4, None, 3, 1000, "cpu")
    packed, packed_tokens = train_step.make_batches("packed", 4, None, 3, 1000, "cpu")
    assert tokens == packed_tokens
    for p, q, n in zip(padded, packed, tokens):
        keep = p["attention_mask"].bool()
        assert int(keep.sum()) == n == q["input_ids"].numel()
        assert torch.equal(p["input_ids"][keep], q["input_ids"][0])
        assert torch.all(p["labels"][~keep] == -100) and torch.equal(p["labels"][keep], p["input_ids"][keep])
        starts = q["position_ids"][0] == 0
        assert int(starts.sum()) == 4 and torch.all(q["labels"][0][starts] == -100)
    bucketed, _ = train_step.make_batches("padded", 4, None, 3, 1000, "cpu", multiple=256)
    assert all(b["input_ids"].shape[1] % 256 == 0 for b in bucketed)
    lengths = train_step.document_lengths(20000, torch.Generator().manual_seed(0))
    assert min(lengths) == 64 and max(lengths) == 4096
    assert 480 <= sorted(lengths)[10000] <= 545  # the median, 512


def test_varying_lengths_warm_up_on_the_longest_and_shortest_batch(tmp_path):
    """On SFT data the warm-up adds the timed steps' longest and shortest batches, and the result counts the graphs
    compiled in each phase; packed batches train without a KV cache (HF keeps documents apart only then)."""
    assert train_step.llama_config("tiny", "packed").use_cache is False
    assert train_step.llama_config("tiny", "padded").use_cache is True
    path = tmp_path / "r.jsonl"
    train_step.main(["--variant", "eager", "--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--data", "packed",
                     "--steps", "2", "--warmup", "1", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["warmup"] == 3 and result["steps"] == 2
    assert result["warmup_compiles"] == 0 and result["timed_compiles"] == 0


def test_profile_new_length_cuts_the_longest_batch_to_a_length_no_batch_has():
    """--profile-new-length: a size the graph of dynamic shapes has not met, from the batch of most positions."""
    for data in ("padded", "packed"):
        batches, _ = train_step.make_batches(data, 4, None, 6, 1000, "cpu")
        new = train_step.batch_of_a_new_length(batches)
        lengths = {b["input_ids"].shape[1] for b in batches}
        length = new["input_ids"].shape[1]
        assert length not in lengths and length > max(lengths) - len(lengths) - 1
        longest = max(batches, key=lambda b: b["input_ids"].shape[1])
        assert new.keys() == longest.keys()
        assert all(torch.equal(new[k], longest[k][:, :length]) for k in new)


def _benchmark_rank(rank, init, argv, out):
    """A rank of `--engine` runs: joins the process group as torchrun would have set it up, then runs the benchmark
    (which finds the group already there)."""
    torch.set_num_threads(1)
    init_rank(rank, init)
    train_step.main(argv)
    torch.save(None, f"{out}.{rank}")  # spawn reads one file per rank


@pytest.mark.parametrize("variant, engine", [("graphopt", "ddp"), ("eager", "fsdp2")])
def test_engines_train_on_two_processes_and_report_once(tmp_path, capsys, variant, engine):
    """--engine on two gloo processes: rank 0 alone writes the result, with the ranks' tokens together (each its own
    batches) and the slowest rank's time; the table names the engine and scales it against the one-process row."""
    path = tmp_path / "r.jsonl"
    argv = ["--variant", variant, "--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "2",
            "--warmup", "1", "--seq", "32", "--batch", "2", "--json", str(path)]
    train_step.main(argv)
    spawn(_benchmark_rank, argv + ["--engine", engine])
    alone, both = [json.loads(line) for line in path.read_text().splitlines()]
    assert (alone["world_size"], both["world_size"], both["engine"]) == (1, 2, engine)
    assert both["tokens_per_step"] == 2 * alone["tokens_per_step"] == 2 * 2 * 32
    assert math.isfinite(both["loss"]) and both["loss"] != alone["loss"]  # the mean over other batches too
    capsys.readouterr()
    train_step.print_table(path)
    name = train_step.engines.NAMES[engine]
    row = next(line for line in capsys.readouterr().out.splitlines() if f"({name} × 2)" in line)
    scaling = float(row.rstrip(" |").rsplit("|", 1)[1])
    assert scaling == pytest.approx(both["tokens_per_s"] / (2 * alone["tokens_per_s"]), abs=0.01)
    # the record says which wrapper Inductor generated, and the table tells a C++ wrapper's row apart
    assert alone["inductor_wrapper"] == ("Python" if variant == "graphopt" else None)
    path.write_text(json.dumps({**alone, "inductor_wrapper": "C++"}) + "\n")
    train_step.print_table(path)
    assert "(Inductor's C++ wrapper)" in capsys.readouterr().out


def test_an_engine_needs_a_launcher():
    with pytest.raises(SystemExit):
        train_step.parse_args(["--variant", "eager", "--engine", "ddp"])
