"""A plan directory: what graphopt.optimize() (and `graphopt optimize`) writes, and options={"plan": DIR} reads.

    DIR/plan.json      versions, device, the model's fingerprint, the options, and the plan of every graph the
                       training step compiled (graphopt/plan.py)
    DIR/report.txt     the plans rendered (also report.json and report.html)
    DIR/compiled.tar   the compile's own Inductor cache folder: the forward and backward as AOTAutograd
                       partitioned them (its cache), the compiled graphs (Inductor's FX graph cache), their C++
                       builds and Triton kernels, graphopt's Triton kernels
    DIR/manifest.json  the SHA-256 of each file above

A later process compiling the same model with options={"plan": DIR} checks the versions and the device, loads the
compiled files, and gives each graph the decisions saved for the graph of the same inputs: the same fusions
(checked), the memory plan the first compile chose, without its search. AOTAutograd and Inductor then find every
graph in their caches instead of tracing the backward, partitioning and compiling it. The compiled files are code:
they load only from the directory named, only when their hashes match the manifest, and a plan directory is to be
trusted like a Python package.

Why the cache folder and not torch.compiler.save_cache_artifacts(): those artifacts hold the FX graph cache's
entries but not the C++ builds of CPU kernels, which a later process then builds again (tiny model on the CPU: a
second process's first step took 27–31 s with them against 35 s cold, and 10 s with the folder). The folder holds
AOTAutograd's entries too (the compile here runs with its cache on): a later process then runs Dynamo's trace and
graphopt's passes only, and is served the partitioned, compiled graphs. torch.compile(...).aot_compile() would
also skip the trace and the passes, but compiles a function of fixed signature whole, not the model a training
loop calls (docs/architecture.md; measured in benchmarks/RESULTS.md).
"""

import contextlib
import functools
import hashlib
import json
import os
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.utils import fresh_cache

import graphopt
from graphopt import report as render
from graphopt.devices import detect
from graphopt.fingerprint import code_fingerprint
from graphopt import model_source
from graphopt.options import PLANNED, OptionError, parse_options
from graphopt.passes.registry import FUSIONS
from graphopt.plan import Plan
from graphopt.report import reports

SCHEMA = "graphopt.plan-dir/1"
FILES = ("plan.json", "report.txt", "report.json", "report.html", "compiled.tar")
MANIFEST = "manifest.json"
HOW_TO_FIX = "make it again for this set-up: graphopt.optimize(model, example_inputs, DIR) or `graphopt optimize`"


def optimize(model: torch.nn.Module, example_inputs: dict, out_dir, options: dict = None) -> Path:
    """Compile the training step of model once (forward, and backward when the output holds a loss that needs
    gradients) on example_inputs, the model's keyword inputs (e.g. input_ids and labels), and write the plan
    directory out_dir. The model is left as it was: its gradients, and the random state the step drew from.
    Dynamo's caches are reset before and after (torch._dynamo.reset()), so that the step compiles here rather
    than running a graph compiled earlier: a model compiled before in this process compiles again at its next
    call."""
    options = dict(options or {})
    if "plan" in options:
        raise OptionError("optimize makes a plan: leave the plan option out")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "plan.json").exists():
        raise FileExistsError(f"{out} holds files and no plan: name an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)

    first = len(reports())
    grads = {p: p.grad for p in model.parameters()}
    rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    torch._dynamo.reset()  # the graphs compile here, not from Dynamo's memory of an earlier compile
    try:
        # an empty cache folder of its own (Inductor's and Triton's), which then holds this compile alone
        with fresh_cache(), _writing_plan():
            model_source.training_step(torch.compile(model, backend="graphopt", options=options), example_inputs)
            with tarfile.open(out / "compiled.tar", "w") as archive:
                archive.add(cache_dir(), arcname=".")
    finally:
        for p, grad in grads.items():
            p.grad = grad
        torch.random.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        torch._dynamo.reset()
    plans = reports()[first:]

    device = detect()
    saved = {
        "schema": SCHEMA,
        "versions": versions(),
        "device": {"target": plans[0].target if plans else device.target, "name": device.name, "arch": device.arch},
        "model": model_fingerprint(model),
        "inputs": {name: tensor_text(value) for name, value in example_inputs.items()},
        "options": options,
        "graphs": [plan.to_json() for plan in plans],
    }
    (out / "plan.json").write_text(json.dumps(saved, indent=2))
    (out / "report.txt").write_text("\n\n".join(render.text(plan) for plan in plans) + "\n")
    (out / "report.json").write_text(json.dumps([plan.to_json() for plan in plans], indent=2))
    (out / "report.html").write_text("\n".join(render.html(plan) for plan in plans))
    (out / MANIFEST).write_text(json.dumps({name: _sha256(out / name) for name in FILES}, indent=2))
    return out


def main(argv=None) -> None:
    """`graphopt optimize MODEL --out DIR [--batch B --seq S --options JSON]`, or with `--export FORMAT
    [--decompose --merge-lora]` an inference program of the fused model (graphopt/export.py)."""
    import argparse

    from graphopt.export import COMMAND_FORMATS, command

    parser = argparse.ArgumentParser(prog="graphopt optimize", description=optimize.__doc__.split(".")[0])
    model_source.add_arguments(parser)
    parser.add_argument("--out", required=True, help="the plan directory to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--export", metavar="FORMAT", choices=COMMAND_FORMATS,
                        help="write an inference program of the fused model instead of a training plan: "
                             f"{', '.join(COMMAND_FORMATS)} (docs/export.md)")
    parser.add_argument("--decompose", action="store_true", help="with --export: graphopt's ops decomposed into "
                                                                 "standard ops (ONNX runnable in onnxruntime)")
    parser.add_argument("--merge-lora", action="store_true", help="with --export: LoRA merged into the base "
                                                                  "weights (PEFT's merge_and_unload)")
    args = parser.parse_args(argv)
    model = model_source.load_model(args.model, model_source.DTYPES[args.dtype], args.device, args.lora_rank)
    if args.export:
        return command(model, args)
    out = optimize(model, model_source.example_inputs(model, args.batch, args.seq, args.device), args.out,
                   json.loads(args.options))
    print((out / "report.txt").read_text())
    print(f"plan written to {out}; train with torch.compile(model, backend=\"graphopt\", "
          f"options={{\"plan\": \"{out}\"}})")


def model_fingerprint(model: torch.nn.Module) -> dict:
    """What identifies the model a plan was made for: its class, its config (HF models) and a hash of its
    parameters' names, shapes, dtypes and whether they train."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}\n".encode())
    config = getattr(model, "config", None)
    return {"class": type(model).__name__, "config": config.to_dict() if hasattr(config, "to_dict") else None,
            "parameters": digest.hexdigest()}


@dataclass
class PlanDir:
    """A plan directory read back and verified (load())."""

    path: Path
    saved: dict
    graphs: list  # Plan per saved graph

    def plan_for(self, plan: Plan):
        """The saved plan of the graph with the same inputs as plan's (names, shapes, dtypes), or None for a graph
        the training step did not compile (e.g. another batch shape) of the same model. A graph that reads
        parameters no saved graph reads belongs to another model: an error."""
        for saved in self.graphs:
            if saved.inputs == plan.inputs:
                return saved
        if plan.parameters and all(saved.parameters != plan.parameters for saved in self.graphs):
            raise OptionError(f"plan={str(self.path)!r} was made for another model (its graphs read other parameters "
                              f"than this one's, model {self.saved['model']['class']}); {HOW_TO_FIX}")
        return None

    def check_target(self, target: str) -> None:
        if target != self.saved["device"]["target"]:
            raise OptionError(f"plan={str(self.path)!r} was made for target {self.saved['device']['target']!r} "
                              f"({self.saved['device']['name']}), and this graph runs on {target!r}; {HOW_TO_FIX}")


_WRITING = [False]


@contextlib.contextmanager
def _writing_plan():
    _WRITING[0] = True
    try:
        yield
    finally:
        _WRITING[0] = False


def writing() -> bool:
    """Whether graphopt.optimize is compiling: each graph's compiled files then include AOTAutograd's entry, which a
    process given the plan loads without tracing the backward or partitioning again (graphopt/pipeline.py)."""
    return _WRITING[0]


def requested_partition(saved: Plan | None) -> dict | None:
    """The partition settings a saved graph was compiled with (its key in the caches, passes/recompute.py), or
    None without a saved graph."""
    if saved is None:
        return None
    return {name: saved.options[name] for name in ("memory_budget", "offload", "max_memory_gib")}


def apply(options, plan: Plan):
    """(the options a graph compiles under, its saved plan or None) for a graph compiled with options.plan: the
    saved decisions of the graph with the same inputs (the fusions enabled, the memory budget and offload chosen,
    CUDA graphs on or off), else the options the plan was made with."""
    directory = load(options.plan, (options.plan / MANIFEST).read_text())
    directory.check_target(plan.target)
    saved = directory.plan_for(plan)
    made = dict((saved or directory.graphs[0]).options)
    if saved is not None and saved.saved_for_backward:
        made.update(memory_budget=saved.saved_for_backward["memory_budget"], max_memory_gib=None,
                    offload=saved.saved_for_backward["offload"] is not None)
    if saved is not None and saved.cuda_graphs:
        made["cuda_graphs"] = saved.cuda_graphs["on"]
    chosen = parse_options({k: v for k, v in made.items() if k in PLANNED}, FUSIONS)
    plan.notes.append(f"plan {options.plan}: " + (
        f"the decisions saved for its graph {saved.graph} (the same inputs): fusions, memory_budget "
        f"{chosen.memory_budget:g}{' with offload' if chosen.offload else ''}, without a search; its "
        f"compiled files loaded" if saved is not None else
        "no saved graph has these inputs (another batch shape?): compiled anew, with the options the plan was made "
        "with"))
    return replace(chosen, target=options.target, report=options.report, plan=options.plan), saved


def check_same_fusions(saved: Plan, plan: Plan) -> None:
    """A graph given a saved plan fuses what the saved graph fused, node for node; else its model's code is not
    the one the plan was made for (another transformers or peft version, an edited model)."""
    made = [(r.pattern, r.key) for r in saved.fusions]
    found = [(r.pattern, r.key) for r in plan.fusions]
    if made != found:
        first = next((a, b) for a, b in zip(made + [None] * len(found), found + [None] * len(made)) if a != b)
        raise OptionError(f"plan={str(plan.options['plan'])!r}: this graph's fusions differ from the saved graph's "
                          f"(saved {first[0]}, found {first[1]}): the model's code is not the one the plan was "
                          f"made for; {HOW_TO_FIX}")


@functools.cache
def load(path: Path, manifest: str) -> PlanDir:
    """The plan directory at path whose manifest reads manifest, verified: every file's SHA-256 as the manifest
    says, then graphopt's code, torch's version and this machine's device kind as when it was made. Its compiled
    files go into this process's cache folders once per process and manifest (a directory written again is read
    again)."""
    manifest = json.loads(manifest)
    for name in FILES:
        if name not in manifest or _sha256(path / name) != manifest[name]:
            raise OptionError(f"plan={str(path)!r}: {name} does not match the SHA-256 of {MANIFEST} (changed since "
                              f"it was written, or missing): not loaded; {HOW_TO_FIX}")
    saved = json.loads((path / "plan.json").read_text())
    if saved.get("schema") != SCHEMA:
        raise OptionError(f"plan={str(path)!r} is not a {SCHEMA} plan directory; {HOW_TO_FIX}")
    made, here = saved["versions"], versions()
    for key, what in (("graphopt", "graphopt"), ("graphopt_code", "graphopt's code"), ("torch", "torch")):
        if made.get(key) != here[key]:
            raise OptionError(f"plan={str(path)!r} was made with {what} {made.get(key)}, and this is {here[key]}; "
                              f"{HOW_TO_FIX}")
    device = detect()
    if (saved["device"]["target"] != "cpu" and
            (device.target, device.arch) != (saved["device"]["target"], saved["device"]["arch"])):
        raise OptionError(f"plan={str(path)!r} was made on {saved['device']['name']} "
                          f"({saved['device']['target']} {saved['device']['arch']}), and this machine has "
                          f"{device.describe()}; {HOW_TO_FIX}")
    _unpack(path / "compiled.tar")
    return PlanDir(path, saved, [Plan.from_json(graph) for graph in saved["graphs"]])


def _unpack(archive: Path) -> None:
    """The saved cache folder into this process's: Inductor's entries into its cache folder, Triton's (the
    folder's triton/) into Triton's. Only regular files and folders, inside those folders (tarfile's data filter)."""
    triton_dir = _triton_cache_dir()
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        tar.extractall(cache_dir(), members=[m for m in members if not _in_triton(m)], filter="data")
        for member in members:
            if triton_dir and _in_triton(member) and member.name.count("/") > 1:
                member.name = member.name.split("/", 2)[2]
                tar.extract(member, triton_dir, filter="data")
                if member.isfile() and Path(member.name).name.startswith("__grp__"):
                    _relocate_group(Path(triton_dir) / member.name)


def _relocate_group(path: Path) -> None:
    """Triton's group file names its kernel's files by absolute path, in the folder graphopt.optimize compiled into
    (deleted since): a lookup finds the group, misses those paths and compiles the kernel again. The files sit
    beside the group file now; it is pointed at them there."""
    group = json.loads(path.read_text())
    if isinstance(group.get("child_paths"), dict):
        group["child_paths"] = {name: str(path.parent / Path(child).name)
                                for name, child in group["child_paths"].items()}
        path.write_text(json.dumps(group))


def _triton_cache_dir():
    """Where Triton looks for compiled kernels; None without Triton (then there are none to reuse)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    try:
        import triton
    except ImportError:
        return None
    return triton.knobs.cache.dir


def _in_triton(member) -> bool:
    return member.name == "./triton" or member.name.startswith("./triton/")


def versions() -> dict:
    return {"graphopt": graphopt.__version__, "graphopt_code": code_fingerprint()[:16], "torch": torch.__version__}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def tensor_text(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}[{', '.join(map(str, value.shape))}] on {value.device}"
    return repr(value)
