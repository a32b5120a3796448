"""Tokens/s and peak GPU memory of one LoRA training step, one variant per process.

    python benchmarks/train_step.py --variant inductor --shape 1b --batch 4 --seq 2048 --json results.jsonl
    python benchmarks/train_step.py --table results.jsonl

Variants: eager (plain PyTorch), inductor (torch.compile), graphopt (torch.compile with backend="graphopt"),
liger (Liger-Kernel's Llama patches, eager), unsloth (FastLanguageModel). Every variant trains the same
randomly initialized Llama (same seed, same batches) with PEFT LoRA r=16 on the 7 projections and AdamW over the
trainable parameters. A step is forward with labels -> backward -> optimizer.step -> zero_grad.
benchmarks/run_train_step.sh runs all of them, each in its own process, and prints the table.

--data picks the batches:
  fixed   one batch of --batch × --seq random tokens, every step (the kernels' best case)
  padded  SFT: --batch documents a step, their lengths drawn from SFT_LENGTHS, right-padded to the longest of
          the step (HF's DataCollatorWithPadding), pads masked in attention_mask and labels
  packed  SFT: the same documents, padding-free as HF's DataCollatorWithFlattening packs them: one row, per-
          document position_ids, the first label of each document -100
tokens/s counts the documents' tokens only (what a padded step spends on pads is lost time).

--engine ddp or fsdp2 trains on several GPUs, one process each, under torchrun (benchmarks/engines.py).

Memory: the peak over the timed steps, allocated and reserved. Before them, for every variant alike, the
allocator's cache goes back to the device (what compiles and autotuning left) and one more untimed step maps
again what the step needs; the warm-up's own peaks are recorded beside it (warmup_peak_reserved_gib and
warmup_peak_alloc_gib), with what was reserved when it began (reserved_before_warmup_gib: what loading left).
"""

import os
import sys


def _variant_in_argv(argv):
    """The --variant value, read before argparse so that Unsloth can be imported first."""
    for i, arg in enumerate(argv):
        if arg == "--variant" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--variant="):
            return arg.split("=", 1)[1]
    return None


# Unsloth patches transformers, peft and trl when it is imported, so it has to be imported before any of them.
if _variant_in_argv(sys.argv[1:]) == "unsloth":
    # The GPU machine has no network: fail at once rather than retry downloads.
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Otherwise its from_pretrained downloads a file from the Hub to count users.
    os.environ["UNSLOTH_DISABLE_STATISTICS"] = "1"
    # It writes generated modules to ./unsloth_compiled_cache by default: keep them out of the repository.
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", "/tmp/unsloth_compiled_cache")
    import unsloth  # noqa: F401
elif _variant_in_argv(sys.argv[1:]) == "graphopt":
    # graphopt sets up the CUDA allocator when it is imported (expandable segments), before the model loads, as
    # its README says to import it
    import graphopt  # noqa: F401

import argparse
import bisect
import datetime
import gc
import json
import math
import platform
import re
import tempfile
import time

import torch

import engines
from common import device_name, host_link_gib_s, launch_us, version_of

VARIANTS = ("eager", "inductor", "graphopt", "liger", "unsloth")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R = 16
LORA_ALPHA = 16
LEARNING_RATE = 1e-4
MODEL_SEED = 0
DATA_SEED = 1234

# The SFT length distribution (--data padded/packed): log-normal, median 512 tokens, sigma 1.0 (the 90th
# percentile near 1,840), clipped to 64–4,096 tokens (1.9% of documents at the 4,096 clip). Long-tailed as
# instruction and chat data sets are: most documents short, a few at the model's context limit.
SFT_LENGTHS = dict(median=512, sigma=1.0, shortest=64, longest=4096)

# Llama-3.2-1B's shape (tied embeddings), Llama-3-8B's (untied), and a tiny one for a CPU smoke test.
SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # a model a CPU can train: the CPU lowering's benchmark (issue 5)
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1408, vocab_size=32000, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=128, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def llama_config(shape, data="fixed"):
    """Packed batches train without a KV cache: only then does HF keep the documents apart (TRL's padding-free
    training and gradient checkpointing turn the cache off too)."""
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, use_cache=data != "packed",
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def build_model(config, dtype, device):
    """A randomly initialized LlamaForCausalLM, created directly on the device (no CPU copy, no download)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(MODEL_SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model


def quantize_4bit(model, dtype):
    """QLoRA's base: every projection of the decoder layers (not the lm_head) as a bitsandbytes NF4 Linear4bit with
    double quantization, computing in dtype, quantized on its device from the weights it had (what from_pretrained
    with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True) loads,
    without a copy on disk)."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, torch.nn.Linear):
                    continue
                device = linear.weight.device
                quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                              compute_dtype=dtype, quant_type="nf4", compress_statistics=True,
                                              device="meta")
                quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4",
                                                     compress_statistics=True).to(device)
                if linear.bias is not None:
                    quantized.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
                setattr(parent, name, quantized)
    return model


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES,
                      bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def save_tokenizer(directory):
    """A tiny word-level tokenizer: Unsloth loads a tokenizer from the model directory and none can be
    downloaded. Its vocabulary is much smaller than the model's; the benchmark feeds random token ids anyway."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Ids 1 and 2 are LlamaConfig's default bos/eos ids; the pad token differs from eos, so Unsloth keeps it.
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = ["the", "a", "of", "to", "and", "in", "is", "it", "that", "for"]
    vocab = {token: i for i, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(directory)


def prepare_unsloth(args, config, dtype, device):
    """Unsloth loads only from a directory: save the random model and a tokenizer, then load them through
    FastLanguageModel as a user would (LoRA on the 16-bit model, or with --quant nf4 its load_in_4bit=True QLoRA;
    its own gradient checkpointing)."""
    from unsloth import FastLanguageModel

    # Kept alive by the caller until the process ends: the loaded model may still map the saved files.
    workdir = tempfile.TemporaryDirectory(prefix="train_step_unsloth_")
    model_dir = os.path.join(workdir.name, "llama")
    base = build_model(config, dtype, device)
    base.save_pretrained(model_dir)
    save_tokenizer(model_dir)
    # Free the first copy before Unsloth loads its own.
    del base
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_dir,
        max_seq_length=args.seq if args.data == "fixed" else SFT_LENGTHS["longest"],
        dtype=dtype,
        load_in_4bit=args.quant == "nf4",
        use_exact_model_name=True,  # a local directory: no name remapping to Hub repos
        local_files_only=True,
        offload_embedding=False,  # keep every weight on the GPU, as in the other variants
    )
    # Unsloth could resize the embeddings to the tokenizer; the comparison needs the model's full vocabulary.
    rows = model.get_input_embeddings().weight.shape[0]
    if rows != config.vocab_size:
        raise RuntimeError(f"Unsloth resized the embeddings to {rows} rows; the model has {config.vocab_size}")
    model = FastLanguageModel.get_peft_model(
        model,
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0,
        target_modules=TARGET_MODULES,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    FastLanguageModel.for_training(model)
    return model, workdir


def prepare(args, device, dtype):
    """(model to take the parameters from, callable that runs the forward, anything to keep alive)."""
    config = llama_config(args.shape, args.data)
    if args.variant == "unsloth":
        model, keep_alive = prepare_unsloth(args, config, dtype, device)
        return model, engines.wrap(model, args.engine, dtype, device), keep_alive

    if args.variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # Patches the transformers Llama classes, so it must run before the model is built.
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)

    model = build_model(config, dtype, device)
    if args.quant == "nf4":
        quantize_4bit(model, dtype)
    model = add_lora(model)
    # Liger's fused linear+cross-entropy only runs in training mode.
    model.train()
    wrapped = engines.wrap(model, args.engine, dtype, device)
    if args.variant == "inductor":
        return model, torch.compile(wrapped), None
    if args.variant == "graphopt":
        import graphopt  # noqa: F401  (for graphopt.last_report(); the backend itself comes by entry point)

        if args.engine == "ddp":  # as graphopt's README says to run DDP: one graph a step, not one per bucket
            torch._dynamo.config.optimize_ddp = False
        return model, torch.compile(wrapped, backend="graphopt", options=json.loads(args.options)), None
    return model, wrapped, None


def document_lengths(count, generator):
    """count lengths drawn from SFT_LENGTHS."""
    lengths = torch.empty(count, dtype=torch.float64).log_normal_(math.log(SFT_LENGTHS["median"]),
                                                                  SFT_LENGTHS["sigma"], generator=generator)
    return lengths.round().clamp(SFT_LENGTHS["shortest"], SFT_LENGTHS["longest"]).long().tolist()


def make_batches(data, batch, seq, count, vocab_size, device, multiple=1, seed=DATA_SEED):
    """count batches (dicts of the model's keyword inputs) and the documents' tokens in each; the same for every
    variant. Labels are the inputs (the model shifts them), -100 where nothing is to be predicted. Padded batches
    are padded to a multiple of `multiple` (the collators' pad_to_multiple_of: length buckets)."""
    generator = torch.Generator().manual_seed(seed)
    if data == "fixed":
        input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator).to(device)
        return [dict(input_ids=input_ids, labels=input_ids)] * count, [batch * seq] * count

    batches, tokens = [], []
    for _ in range(count):
        lengths = document_lengths(batch, generator)
        documents = [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]
        if data == "padded":
            longest = -(-max(lengths) // multiple) * multiple
            input_ids = torch.zeros(batch, longest, dtype=torch.long)
            attention_mask = torch.zeros(batch, longest, dtype=torch.long)
            for row, document in enumerate(documents):
                input_ids[row, :len(document)] = document
                attention_mask[row, :len(document)] = 1
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            step = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        else:
            input_ids = torch.cat(documents)[None]
            position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
            labels = input_ids.masked_fill(position_ids == 0, -100)
            step = dict(input_ids=input_ids, position_ids=position_ids, labels=labels)
        batches.append({name: t.to(device) for name, t in step.items()})
        tokens.append(sum(lengths))
    return batches, tokens


def train_step(forward, optimizer, batch, autocast=None):
    """One step; with autocast (a dtype) the forward runs under torch.autocast, as HF's bf16=True / fp16=True."""
    torch.compiler.cudagraph_mark_step_begin()  # a new step: CUDA graph trees may reuse the last step's outputs
    with torch.autocast(batch["input_ids"].device.type, autocast or torch.bfloat16, enabled=autocast is not None):
        loss = forward(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def batch_of_a_new_length(batches):
    """The batch of most positions cut to the longest length no batch has (padded or packed: its rows cut short, so
    its last documents lose their tails), contiguous as a collator's: a view's strides would be a new guard for
    Dynamo, and the step a recompile rather than a new length."""
    met = {b["input_ids"].shape[1] for b in batches}
    longest = max(batches, key=lambda b: b["input_ids"].shape[1])
    length = max(n for n in range(1, longest["input_ids"].shape[1]) if n not in met)
    return {name: t[:, :length].contiguous() for name, t in longest.items()}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Where a step's device time goes, by kind of kernel (first matching pattern wins; names lowercased).
KERNEL_KINDS = (
    ("matmul (cuBLAS/CUTLASS)", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("flash", "fmha", "attention", "efficient_attention")),
    ("graphopt Triton kernels", ("_rms_norm", "_rope", "_gated", "_cross_entropy", "_project", "_reduce_rows",
                                 "_sum_splits", "_add_low_rank")),
    ("Inductor-generated Triton", ("triton_",)),
    ("copies and fills", ("memcpy", "memset", "copy_", "fill_")),
)


def profile_steps(forward, optimizer, batch, device, path, steps=2, autocast=None):
    """Profile a few more steps: print device time per kind of kernel and the top kernels; chrome trace to path."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(forward, optimizer, batch, autocast)
        synchronize(device)
    prof.export_chrome_trace(path)
    kernels = [e for e in prof.key_averages() if e.device_type.name == ("CUDA" if device.type == "cuda" else "CPU")]
    time_of = (lambda e: e.self_device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    total = sum(time_of(e) for e in kernels) or 1
    kinds = {}  # kind → (µs, launches)
    for e in kernels:
        kind = next((k for k, patterns in KERNEL_KINDS if any(p in e.key.lower() for p in patterns)), "other")
        us, launches = kinds.get(kind, (0, 0))
        kinds[kind] = (us + time_of(e), launches + e.count)
    print(f"\nprofile of {steps} steps ({total / 1000 / steps:.1f} ms of kernel time per step); trace: {path}",
          file=sys.stderr)
    for kind, (us, launches) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"  {kind:<28} {us / 1000 / steps:8.2f} ms/step  {100 * us / total:5.1f}%  ×{launches // steps}",
              file=sys.stderr)
    print("  top kernels:", file=sys.stderr)
    for e in sorted(kernels, key=time_of, reverse=True)[:40]:
        print(f"    {time_of(e) / 1000 / steps:8.2f} ms/step ×{e.count // steps:<5} {e.key[:100]}", file=sys.stderr)
    if device.type == "cuda":
        print_stream_timeline(path, steps)
        print_device_copies(path, steps)
        print_host_time(prof, steps)


def print_host_time(prof, steps, top=25):
    """Where the host's time goes (the profiler's CPU events, by self time): a step whose compute stream waits
    between launches is bound by these."""
    host = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    total = sum(e.self_cpu_time_total for e in host) or 1
    print(f"  host: {total / 1000 / steps:.1f} ms/step of self time in profiled CPU events; the largest:",
          file=sys.stderr)
    for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        print(f"    {e.self_cpu_time_total / 1000 / steps:8.2f} ms/step ×{e.count // steps:<5} {e.key[:100]}",
              file=sys.stderr)


def stream_timeline(events):
    """{stream: (ops, busy µs, copies µs, idle gaps in µs)} from profiler trace events on a device ("ph": "X")."""
    by_stream, timeline = {}, {}
    for e in events:
        by_stream.setdefault(e["args"].get("stream"), []).append((e["ts"], e["ts"] + e["dur"], e["cat"]))
    for stream, spans in by_stream.items():
        spans.sort()
        busy, gaps, end = 0.0, [], spans[0][0]
        for start, stop, _ in spans:
            if start > end:
                gaps.append(start - end)
            busy += max(0.0, stop - max(start, end))  # overlapping spans (concurrent kernels) counted once
            end = max(end, stop)
        copies = sum(stop - start for start, stop, cat in spans if cat != "kernel")
        timeline[stream] = (len(spans), busy, copies, gaps)
    return timeline


def print_stream_timeline(trace_path, steps):
    """Per CUDA stream: how much of the profiled wall time it was busy, and its idle gaps. Tells a step waiting
    for the CPU to launch (the compute stream idle in many short gaps) from one waiting for copies (the compute
    stream idle while the copy stream is busy) from one bound by its kernels (the compute stream busy)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return
    wall = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    print(f"  streams over {wall / 1000 / steps:.1f} ms/step of wall time:", file=sys.stderr)
    for stream, (ops, busy, copies, gaps) in sorted(stream_timeline(events).items(), key=lambda kv: -kv[1][0]):
        long_gaps = [g for g in gaps if g >= 100]
        print(f"    stream {stream}: {ops // steps} ops/step, busy {busy / 1000 / steps:.1f} ms/step "
              f"(copies {copies / 1000 / steps:.1f}), idle {sum(gaps) / 1000 / steps:.1f} ms/step in "
              f"{len(gaps) // steps} gaps, {len(long_gaps) // steps} of them ≥100 µs "
              f"({sum(long_gaps) / 1000 / steps:.1f} ms/step)", file=sys.stderr)


def print_device_copies(trace_path, steps, top=8, nesting=3):
    """The device-to-device copies of the profiled steps, by the host ops that made them (the innermost `nesting`
    ops enclosing each copy's runtime call): a whole activation copied where no op of the model asks for one is
    memory traffic to find (benchmarks/RESULTS.md, SFT AF)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = {}  # thread → its CPU ops, by start
    for e in events:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e["tid"], []).append(e)
    for thread in ops.values():
        thread.sort(key=lambda o: o["ts"])
    starts = {tid: [o["ts"] for o in thread] for tid, thread in ops.items()}
    made_by = {}  # chain of ops → (copies, µs)
    for e in events:
        if e.get("cat") != "gpu_memcpy" or "DtoD" not in e["name"]:
            continue
        call, chain = calls.get(e["args"].get("correlation")), "?"
        if call is not None:
            # the innermost enclosing ops start shortly before the call: among the nearest few hundred
            first = bisect.bisect_right(starts.get(call["tid"], []), call["ts"])
            enclosing = [o for o in ops.get(call["tid"], [])[max(0, first - 300):first]
                         if o["ts"] + o["dur"] >= call["ts"] + call["dur"]]
            chain = " ← ".join(o["name"][:50] for o in sorted(enclosing, key=lambda o: o["dur"])[:nesting]) or "?"
        count, us = made_by.get(chain, (0, 0.0))
        made_by[chain] = (count + 1, us + e["dur"])
    if not made_by:
        return
    print("  device-to-device copies, by the host ops that made them (innermost first):", file=sys.stderr)
    for chain, (count, us) in sorted(made_by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {us / 1000 / steps:8.2f} ms/step ×{count // steps:<5} {chain}", file=sys.stderr)


def allocations_at_peak(events, start):
    """Replay the CUDA allocator's history (torch.cuda.memory._snapshot()'s device trace) from `start` bytes
    allocated: (the peak of allocated bytes, {address: alloc event} of what was allocated in the trace and live
    then). A block freed in the trace but allocated before it lowers the total only. An allocation with no
    Python frames (the autograd engine's, in C++) gets "after": the last event before it that had frames."""
    live, total, peak, at_peak, last_framed = {}, start, start, {}, None
    for event in events:
        if event["frames"]:
            last_framed = event
        if event["action"] == "alloc":
            live[event["addr"]] = event if event["frames"] else {**event, "after": last_framed}
            total += event["size"]
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
            total -= event["size"]
        else:
            continue
        if total > peak:
            peak, at_peak = total, dict(live)
    return peak, at_peak


def print_memory_segments(device):
    """The caching allocator's segments now, by pool (the default one, a CUDA graph's), kind and whether they are
    expandable: where reserved memory sits, and how much of it is free inside segments."""
    pools = {}
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != (device.index or 0):
            continue
        pool_id = tuple(segment["segment_pool_id"])
        pool = "default" if pool_id == (0, 0) else f"private {pool_id}"
        key = (pool, segment["segment_type"], "expandable" if segment.get("is_expandable") else "fixed-size")
        row = pools.setdefault(key, [0, 0, 0, 0])
        free = [block["size"] for block in segment["blocks"] if block["state"] == "inactive"]
        row[0] += 1
        row[1] += segment["total_size"]
        row[2] += segment["allocated_size"]
        row[3] = max(row[3], max(free, default=0))
    print("\n| pool | segments | reserved MiB | allocated MiB | largest free block MiB |", file=sys.stderr)
    print("| --- | ---: | ---: | ---: | ---: |", file=sys.stderr)
    for (pool, kind, expandable), (count, total, allocated, largest) in sorted(pools.items(), key=lambda kv: -kv[1][1]):
        print(f"| {pool}, {kind}, {expandable} | {count} | {total / 2**20:,.0f} | {allocated / 2**20:,.0f} | "
              f"{largest / 2**20:,.0f} |", file=sys.stderr)


def print_memory_at_peak(forward, optimizer, batch, device, top=30, autocast=None):
    """One more step under the CUDA allocator's history: replay its allocations and frees, and print what was
    allocated at the step's peak, largest first, each with the source line that allocated it (for Inductor's
    generated code, the line of its wrapper, which names the buffer)."""
    import linecache

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    start = torch.cuda.memory_allocated(device)
    train_step(forward, optimizer, batch, autocast)
    synchronize(device)
    events = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, at_peak = allocations_at_peak(events, start)

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # Inductor's generated code lives in its cache folder (TORCHINDUCTOR_CACHE_DIR moves it)
    sources = ("graphopt", cache_dir(), "/transformers/", "/peft/", "/kernels/", "/lowering/", "/torch/optim/")

    def origin(event):
        for frame in event["frames"]:
            name = frame["filename"]
            if any(part in name for part in sources):
                text = linecache.getline(name, frame["line"]).strip()
                return f"{'/'.join(name.split('/')[-2:])}:{frame['line']} {frame['name']}: {text[:90]}"
        frames = event["frames"]
        if not frames:  # grouped by the call before them: one line for all layers
            before = origin(event["after"]) if event.get("after") else "?"
            call = re.search(r"= ([\w.]+)\(", before)
            return "no Python frames, after a call of " + (call.group(1) if call else before)
        return f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']} {frames[0]['name']}"

    groups = {}
    for event in at_peak.values():
        key = (event["size"], origin(event))
        groups[key] = groups.get(key, 0) + 1
    print(f"\nallocated at the step's peak: {peak / 2**20:,.1f} MiB ({start / 2**20:,.1f} MiB before the step, "
          f"{sum(e['size'] for e in at_peak.values()) / 2**20:,.1f} MiB allocated in it and live then)",
          file=sys.stderr)
    for (size, where), count in sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])[:top]:
        print(f"  {count:>3} × {size / 2**20:9.1f} MiB  {where}", file=sys.stderr)
    # Where the peak falls (a forward's or a backward's generated code), and what each file holds then: the
    # listing above names lines, and a graph's saved activations spread over many of them
    if at_peak:
        print(f"  reached at: {origin(list(at_peak.values())[-1])}", file=sys.stderr)
    files = {}
    for (size, where), count in groups.items():
        name = where.split(":")[0]
        files[name] = files.get(name, 0) + size * count
    for name, size in sorted(files.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {size / 2**20:9.1f} MiB in all from {name}", file=sys.stderr)


def run(args):
    """The result (a dict), in the process that reports it (rank 0), else None."""
    device = torch.device(args.device)
    if args.engine != "none":
        device = engines.init(device)
    dtype = DTYPES[args.dtype]
    autocast = AUTOCAST[args.autocast]
    # What the host brings, measured before the model: hosts of one GPU kind differ (RESULTS.md, ninth session)
    host_link, host_launch_us = host_link_gib_s(device), launch_us(device)
    # keep_alive (Unsloth's saved checkpoint) must outlive the steps: held here until run() returns.
    model, forward, keep_alive = prepare(args, device, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE)

    vocab_size = model.get_input_embeddings().weight.shape[0]
    batches, tokens = make_batches(args.data, args.batch, args.seq, args.warmup + args.steps, vocab_size, device,
                                   args.pad_to_multiple_of, seed=DATA_SEED + engines.rank())
    if args.data != "fixed" and args.variant in ("inductor", "graphopt"):
        # Lengths vary from step to step: Dynamo compiles the first batch for its sizes, the second again with the
        # sequence dimension symbolic, and that graph serves every later step. Marked here, one compile reaches
        # the same graph and the second is not paid in device time.
        for batch in batches:
            for tensor in batch.values():
                torch._dynamo.maybe_mark_dynamic(tensor, 1)

    # Warm-up: compilation, autotuning and the optimizer's state allocation happen here, outside the timing. On
    # lengths that vary, the timed steps' longest and shortest batches run too: a graph compiled for a range of
    # lengths (a guard such as "length ≤ 4096") is then compiled for every length the timed steps meet, once, as
    # a long run pays it once; timed_compiles says whether any compile was left.
    # With --warmup-every-shape, two batches of each shape the timed steps meet: CUDA graph trees run a size
    # eagerly the first time they meet it and record it the second, so every bucket is recorded before the
    # timing, as a long run records each bucket once.
    warmup_batches = batches[:args.warmup]
    if args.data != "fixed":
        timed = batches[args.warmup:]
        warmup_batches += [max(timed, key=lambda b: b["input_ids"].numel()),
                           min(timed, key=lambda b: b["input_ids"].numel())]
        if args.warmup_every_shape:
            warmup_batches += 2 * list({tuple(b["input_ids"].shape): b for b in timed}.values())
    first_loss = None
    warmup_peaks = []  # allocated, per warm-up step
    warmup_reserved = 0  # the allocator's reservation at its highest in the warm-up (compiles, autotuning, recording)
    # what the model's loading left reserved, cached or not, which the warm-up's peak reservation includes
    reserved_before_warmup = torch.cuda.memory_reserved(device) if device.type == "cuda" else None
    graphs_at_start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    for batch in warmup_batches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss = train_step(forward, optimizer, batch, autocast)
        if first_loss is None:
            first_loss = loss.item()
        if device.type == "cuda":
            synchronize(device)
            warmup_peaks.append(torch.cuda.max_memory_allocated(device))
            warmup_reserved = max(warmup_reserved, torch.cuda.max_memory_reserved(device))
    synchronize(device)
    warmup_s = time.perf_counter() - start
    warmup_compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_at_start
    if args.variant == "graphopt":
        import graphopt

        print(f"graphopt compiled {len(graphopt.reports())} graph(s); the last one's report:", file=sys.stderr)
        print(graphopt.last_report().to_text(), file=sys.stderr)

    reserved_after_warmup = None
    if device.type == "cuda":
        # The steady state's reservation, for every variant alike: what the warm-up's compiles and autotuning left
        # cached goes back to the device first (a CUDA graph's pool stays: its replays use it).
        reserved_after_warmup = torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        # one step more outside the timing: it maps again what the step needs (expandable segments), at its cost
        train_step(forward, optimizer, warmup_batches[-1], autocast)
        synchronize(device)
    # Graphs Dynamo compiles during the timed steps (a recompile there is paid in the timing); Dynamo's log says
    # which guard failed, in the variant's log
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if args.variant in ("inductor", "graphopt"):
        torch._logging.set_logs(recompiles=True)
    start = time.perf_counter()
    for batch in batches[args.warmup:]:
        loss = train_step(forward, optimizer, batch, autocast)
    synchronize(device)
    # several ranks: the slowest rank's time, all ranks' tokens, the highest rank's memory (per GPU)
    seconds = engines.combined(time.perf_counter() - start, "max", device)
    timed_compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    timed_tokens = engines.combined(sum(tokens[args.warmup:]), "sum", device)
    timed_positions = engines.combined(sum(batch["input_ids"].numel() for batch in batches[args.warmup:]), "sum",
                                       device)
    peak_alloc = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    peak_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    peak_alloc, peak_reserved = (engines.combined(peak, "max", device) for peak in (peak_alloc, peak_reserved))
    # the mean over the ranks' batches
    first_loss, last_loss = (engines.combined(value, "sum", device) / engines.world()
                             for value in (first_loss, loss.item()))
    # CUDA graph replays allocate nothing the allocator counts as allocated: their memory pool shows as reserved
    graphs = args.variant == "graphopt" and bool((graphopt.last_report().cuda_graphs or {}).get("on"))
    peak = peak_reserved if graphs else peak_alloc
    # Under CUDA graphs, the allocated peak of the steps after the first (compile) step: the second records the
    # graphs, allocating in their pool what every replay reuses, so this is the allocated peak comparable to the
    # other variants'.
    recording_peak = max(warmup_peaks[1:] + [peak_alloc]) if graphs else None
    estimated_peak = memory_budget = None
    if args.variant == "graphopt" and graphopt.last_report().saved_for_backward:
        memory_budget = graphopt.last_report().saved_for_backward["memory_budget"]  # the one used, default or chosen
        estimate = graphopt.last_report().saved_for_backward["estimate"]
        estimated_peak = estimate["estimated_peak_bytes"]
        if peak is not None:  # what the estimate counts is allocated memory
            graphopt.record_measured_peak(recording_peak if graphs else peak_alloc)
            print(next(line for line in graphopt.last_report().to_text().splitlines() if "estimated peak" in line),
                  file=sys.stderr)
    if args.profile:  # the first timed batch: the same whatever --steps, so runs of different lengths compare
        profile_steps(forward, optimizer, batches[args.warmup], device, args.profile, autocast=autocast)
    if args.profile_new_length:
        new = batch_of_a_new_length(batches)
        print(f"\nA length no step had before ({new['input_ids'].shape[1]}), its first step:", file=sys.stderr)
        profile_steps(forward, optimizer, new, device, f"{args.profile_new_length}-new.json", steps=1,
                      autocast=autocast)
        print("The same batch again:", file=sys.stderr)
        profile_steps(forward, optimizer, new, device, f"{args.profile_new_length}-seen.json", steps=1,
                      autocast=autocast)
    if args.memory_at_peak and device.type == "cuda":  # the batch of most positions sets the peak
        longest = max(batches[args.warmup:], key=lambda b: b["input_ids"].numel())
        print_memory_at_peak(forward, optimizer, longest, device, autocast=autocast)
    if args.memory_segments and device.type == "cuda":
        print_memory_segments(device)

    result = {
        "variant": args.variant,
        "options": args.options if args.variant == "graphopt" else None,
        "memory_budget": memory_budget,
        "shape": args.shape,
        "batch": args.batch,
        "seq": args.seq if args.data == "fixed" else None,
        "data": args.data,
        "pad_to_multiple_of": args.pad_to_multiple_of,
        # SFT data: the documents' tokens a step, and the share of the step's positions that are padding
        "tokens_per_step": timed_tokens / args.steps,
        "pad_fraction": 1 - timed_tokens / timed_positions,
        "dtype": args.dtype,
        "autocast": args.autocast,
        "quant": args.quant,
        "device": device.type,
        "steps": args.steps,
        "warmup": len(warmup_batches),
        "timed_shapes": len({tuple(b["input_ids"].shape) for b in batches[args.warmup:]}),
        "tokens_per_s": timed_tokens / seconds,
        "warmup_s": warmup_s,
        "warmup_compiles": warmup_compiles,
        "timed_compiles": timed_compiles,
        "step_ms": 1000 * seconds / args.steps,
        "cuda_graphs": graphs,
        # the peak compared across variants: allocated, or reserved under CUDA graphs
        "peak_gib": peak / 2**30 if peak is not None else None,
        "peak_alloc_gib": peak_alloc / 2**30 if peak_alloc is not None else None,
        # graphopt's estimate of what its compiled graphs hold at their peak (the report's), beside the measure
        "estimated_peak_gib": estimated_peak / 2**30 if isinstance(estimated_peak, int) else estimated_peak,
        "peak_reserved_gib": peak_reserved / 2**30 if peak_reserved is not None else None,
        "warmup_peak_reserved_gib": warmup_reserved / 2**30 if device.type == "cuda" else None,
        "warmup_peak_alloc_gib": max(warmup_peaks) / 2**30 if warmup_peaks else None,
        "reserved_before_warmup_gib": reserved_before_warmup / 2**30 if reserved_before_warmup is not None else None,
        "reserved_after_warmup_gib": reserved_after_warmup / 2**30 if reserved_after_warmup is not None else None,
        "recording_peak_alloc_gib": recording_peak / 2**30 if recording_peak is not None else None,
        "first_loss": first_loss,
        "loss": last_loss,
        "trainable_params": sum(p.numel() for p in trainable),
        "device_name": device_name(device),
        "host_link_gib_s": host_link,
        "launch_us": host_launch_us,
        # Inductor's generated wrapper, where Inductor compiles: Python unless TORCHINDUCTOR_CPP_WRAPPER=1 asks for C++
        "inductor_wrapper": ("C++" if torch._inductor.config.cpp_wrapper else "Python")
        if args.variant in ("inductor", "graphopt") else None,
        # the caching allocator's settings: Unsloth sets expandable segments on import, graphopt when it compiles
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
        "allocator_note": next((n for n in graphopt.last_report().notes if n.startswith("CUDA allocator")), None)
        if args.variant == "graphopt" else None,
        "torch": torch.__version__,
        "triton": version_of("triton"),
        "transformers": version_of("transformers"),
        "peft": version_of("peft"),
        "liger_kernel": version_of("liger_kernel") if args.variant == "liger" else None,
        "unsloth": version_of("unsloth") if args.variant == "unsloth" else None,
        "unsloth_zoo": version_of("unsloth_zoo") if args.variant == "unsloth" else None,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "engine": args.engine,
        "world_size": engines.world(),
    }
    return result if engines.rank() == 0 else None


def describe(r):
    memory = "n/a" if r["peak_alloc_gib"] is None else \
        f"{r['peak_alloc_gib']:.2f} GiB (reserved {r['peak_reserved_gib']:.2f} GiB" + \
        (f"; in the warm-up {r['warmup_peak_reserved_gib']:.2f} of which {r['reserved_before_warmup_gib']:.2f} before "
         f"it, allocated {r['warmup_peak_alloc_gib']:.2f}; cached after it {r['reserved_after_warmup_gib']:.2f}"
         if r.get("reserved_before_warmup_gib") is not None else "") + ")" + \
        (", CUDA graphs: compare reserved" if r["cuda_graphs"] else "") + \
        (f"; allocated while recording them {r['recording_peak_alloc_gib']:.2f} GiB"
         if r.get("recording_peak_alloc_gib") is not None else "")
    return (f"{r['variant']} {r['options'] or ''}{_engine(r)}: {r['shape']} batch {r['batch']} {_data(r)} "
            f"{r['dtype']} on {r['device_name']}: "
            f"{r['tokens_per_s']:,.0f} tokens/s, {r['step_ms']:.1f} ms/step, peak {memory}, "
            f"loss {r['first_loss']:.4f} -> {r['loss']:.4f}{_describe_host(r)}")


def _engine(r):
    """ " (DDP × 2)" where several processes trained, else "" (results before --engine are of one process)."""
    if r.get("world_size", 1) == 1:
        return ""
    return f" ({engines.NAMES[r['engine']]} × {r['world_size']})"


def _data(r):
    """What a step trains on (results before --data existed are of the fixed batch)."""
    if r.get("data", "fixed") == "fixed":
        return f"seq {r['seq']}"
    buckets = f", padded to multiples of {r['pad_to_multiple_of']}" if r.get("pad_to_multiple_of", 1) > 1 else ""
    return (f"{r['data']} SFT documents ({r['tokens_per_step']:,.0f} tokens a step, "
            f"{100 * r['pad_fraction']:.0f}% padding{buckets})")


def _describe_host(r):
    """What the host brought (CUDA runs since the ninth session; launch_us since its last runs)."""
    parts = []
    if r.get("host_link_gib_s"):
        parts.append(f"pinned copies {r['host_link_gib_s']['d2h']:.0f} GiB/s to it, "
                     f"{r['host_link_gib_s']['h2d']:.0f} back")
    if r.get("launch_us") is not None:
        parts.append(f"{r['launch_us']:.1f} µs a launch")
    return "; host: " + ", ".join(parts) if parts else ""


# --- the table of a results file -------------------------------------------------------------------------

def _number(value, digits):
    return "—" if value is None else f"{value:,.{digits}f}"


def _ratio(value, base):
    return "—" if value is None or not base else f"{value / base:.2f}×"


def _peak(r):
    """The peak compared across variants (older results files have allocated only)."""
    return r.get("peak_gib", r["peak_alloc_gib"])


def _scaling(r, group):
    """Scaling efficiency of a run of several processes: its tokens/s ÷ (processes × the same variant's tokens/s
    in one process, in the same file); "—" without that run."""
    if r.get("world_size", 1) == 1:
        return "—"
    alone = next((one for one in group if one.get("world_size", 1) == 1 and one["variant"] == r["variant"]
                  and one.get("options") == r.get("options") and one.get("quant") == r.get("quant")), None)
    return "—" if alone is None else f"{r['tokens_per_s'] / (r['world_size'] * alone['tokens_per_s']):.2f}"


def print_table(path):
    """A markdown table per configuration, with each variant measured against inductor's row."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    groups = {}
    for r in rows:
        if not r.get("failed"):
            key = (r["shape"], r["batch"], r.get("data", "fixed"), r.get("pad_to_multiple_of", 1), r["seq"], r["dtype"],
                   r["device_name"])
            groups.setdefault(key, []).append(r)

    for (shape, batch, _, _, _, dtype, device), group in groups.items():
        base = next((r for r in group if r["variant"] == "inductor" and r.get("world_size", 1) == 1), None)
        several = any(r.get("world_size", 1) > 1 for r in group)
        print(f"\n{shape}, batch {batch}{' per process' if several else ''}, {_data(group[0])}, {dtype}, {device}, "
              f"{group[0]['date'][:10]}\n")
        print("| variant | tokens/s | step ms | peak GiB | ×inductor tokens/s | ×inductor memory | loss "
              "| warm-up s |" + (" scaling |" if several else ""))
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if several else ""))
        for r in group:
            label = r["variant"] + (f" {r['options']}" if r.get("options") not in (None, "{}") else "") + _engine(r)
            label += " (QLoRA nf4)" if r.get("quant") == "nf4" else ""
            label += " (Inductor's C++ wrapper)" if r.get("inductor_wrapper") == "C++" else ""
            label += " (CUDA graphs: peak reserved)" if r.get("cuda_graphs") else ""
            print(f"| {label} | {_number(r['tokens_per_s'], 0)} | {_number(r['step_ms'], 1)} "
                  f"| {_number(_peak(r), 2)} "
                  f"| {_ratio(r['tokens_per_s'], base and base['tokens_per_s'])} "
                  f"| {_ratio(_peak(r), base and _peak(base))} "
                  f"| {_number(r['loss'], 4)} | {_number(r.get('warmup_s'), 0)} |" +
                  (f" {_scaling(r, group)} |" if several else ""))

    failed = [r for r in rows if r.get("failed")]
    if failed:
        print("\nfailed:")
        for r in failed:
            print(f"- {r['variant']} (exit code {r['exit_code']}): {r['log']}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before, where compilation happens "
                        "(with --data padded or packed, two more: the timed steps' longest and shortest batches)")
    parser.add_argument("--data", choices=("fixed", "padded", "packed"), default="fixed",
                        help="one fixed batch, or SFT documents of varying length padded per step or packed "
                             "(--seq is then unused: lengths come from SFT_LENGTHS)")
    parser.add_argument("--pad-to-multiple-of", type=int, default=1, metavar="N",
                        help="--data padded: pad each batch to a multiple of N (length buckets, as the collators' "
                             "pad_to_multiple_of), so a graph recorded per size (cuda_graphs=True) is recorded once "
                             "per bucket")
    parser.add_argument("--warmup-every-shape", action="store_true",
                        help="--data padded or packed: warm up on each shape the timed steps meet too, twice (the "
                             "steady state of a long run, where what is recorded per size has been recorded)")
    parser.add_argument("--quant", choices=("none", "nf4"), default="none",
                        help="nf4: QLoRA, the decoder's projections as bitsandbytes NF4 (double quantization) "
                             "computing in --dtype; Unsloth loads with load_in_4bit=True")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST), default="none",
                        help="run the forward under torch.autocast of this dtype (HF's bf16=True: --dtype fp32 "
                             "--autocast bf16)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", choices=engines.ENGINES, default="none",
                        help="ddp or fsdp2: one process per GPU under torchrun, each training --batch rows of its own "
                             "(benchmarks/engines.py)")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line of results to PATH")
    parser.add_argument("--options", default="{}", help="graphopt's options as JSON, e.g. '{\"keep_logits\": true}'")
    parser.add_argument("--profile", metavar="PATH", help="then profile 2 more steps on the first timed batch: "
                        "print where the device time goes (kernels, the streams' idle gaps, device-to-device copies "
                        "by the host ops that made them, the host's time), write a chrome trace to PATH")
    parser.add_argument("--profile-new-length", metavar="PATH", help="then profile one step on a batch of a length "
                        "no step had (a new size for a graph of dynamic shapes), and the same batch once more: "
                        "PATH-new.json, PATH-seen.json")
    parser.add_argument("--memory-at-peak", action="store_true", help="then run one more step (the timed batch of "
                        "most positions) under the CUDA allocator's history and print what is allocated at its "
                        "peak, and where")
    parser.add_argument("--memory-segments", action="store_true", help="then print the CUDA allocator's segments "
                        "by pool (default, a CUDA graph's), kind and expandable or not: reserved, allocated, free")
    parser.add_argument("--table", metavar="PATH", help="print the markdown table of a results file and exit")
    args = parser.parse_args(argv)
    if args.table is None and args.variant is None:
        parser.error("--variant is required (or --table PATH)")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if args.pad_to_multiple_of < 1 or (args.pad_to_multiple_of > 1 and args.data != "padded"):
        parser.error("--pad-to-multiple-of takes a positive N, and pads --data padded batches only")
    if args.engine != "none" and not engines.launched():
        parser.error(f"--engine {args.engine} runs one process per GPU: launch with torchrun --nproc-per-node N")
    if args.engine == "fsdp2" and args.quant != "none":
        parser.error("--engine fsdp2 shards 16-bit weights only here (--quant none)")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table is not None:
        print_table(args.table)
        return
    try:
        result = run(args)
    finally:
        engines.finish()
    if result is None:  # another rank reports
        return
    print(describe(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    if not math.isfinite(result["loss"]):
        sys.exit(f"{args.variant}: the loss is {result['loss']}: this variant computes something wrong")


if __name__ == "__main__":
    main()
