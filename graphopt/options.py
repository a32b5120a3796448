"""Options of torch.compile(model, backend="graphopt", options={...}), validated into one Options object."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TARGETS = ("auto", "cuda", "hip", "npu", "mps", "cpu")
REPORT_SUFFIXES = (".txt", ".json", ".html")


class OptionError(ValueError):
    """A bad option passed to the graphopt backend."""


# The default sizes the plan to the model: the fastest plan whose estimated peak fits 2.75× the parameters' bytes
# (passes/recompute.py WEIGHTS_MULTIPLE). No fixed budget serves every shape: on the H200 under CUDA graphs 0.6 is
# 1.34× inductor in 1.94× Unsloth's memory at the Llama-3.2-1B shape, but at Llama-3-8B's it recomputes what that
# GPU has room to keep (13.2k tokens/s against budget 1's 15.7k; benchmarks/RESULTS.md, 2026-12-01: CUDA graphs by
# default).
DEFAULT_MEMORY_BUDGET = "auto"


@dataclass(frozen=True)
class Options:
    target: str = "auto"
    fusions: frozenset = frozenset()  # names of the enabled fusions
    report: Optional[Path] = None
    keep_logits: bool = False  # materialize the logits even when the loss is fused (training with labels)
    cache_grad: bool = False  # the returned KV cache stays differentiable (passes/detach_cache.py)
    # 1: save what the fastest plan saves; 0: save each decoder layer's input only, recompute the rest layer by
    # layer; "auto": the fastest plan whose estimated peak fits max_memory_gib, or without it a multiple of the
    # weights the graph reads (passes/recompute.py)
    memory_budget: object = DEFAULT_MEMORY_BUDGET
    offload: bool = False  # saved activations go to pinned host memory, prefetched back (passes/offload.py)
    max_memory_gib: Optional[float] = None  # with memory_budget="auto": the device memory the step may use
    # Inductor replays each compiled graph as a CUDA graph: one launch instead of one per kernel, for hosts whose
    # CPU cannot launch the step's ~1,500 kernels as fast as the GPU runs them (benchmarks/RESULTS.md).
    # "auto": where it was measured faster (cuda_graphs_decision)
    cuda_graphs: object = "auto"
    # a plan directory (graphopt/plan_dir.py): its decisions and compiled artifacts instead of a search and a compile
    plan: Optional[Path] = None

    def to_json(self) -> dict:
        """The options as the plan records them: plain JSON values."""
        return {"target": self.target, "fusions": sorted(self.fusions),
                "report": None if self.report is None else str(self.report), "keep_logits": self.keep_logits,
                "cache_grad": self.cache_grad, "memory_budget": self.memory_budget, "offload": self.offload,
                "max_memory_gib": self.max_memory_gib, "cuda_graphs": self.cuda_graphs,
                "plan": None if self.plan is None else str(self.plan)}


def _describe_valid(fusion_names) -> str:
    return (f"valid options: target={'|'.join(TARGETS)}; "
            f"fusions={{name: bool}} or a list of names to enable, names: {', '.join(fusion_names)}; "
            f"report=path ending in {', '.join(REPORT_SUFFIXES)}; keep_logits=True|False; cache_grad=True|False; "
            f"memory_budget=a number from 0 to 1, or \"auto\" (optionally with max_memory_gib=N); offload=True|False; "
            f"cuda_graphs=\"auto\"|True|False; plan=a directory graphopt.optimize wrote")


def parse_options(raw: dict, fusion_names) -> Options:
    fusion_names = tuple(fusion_names)
    unknown = sorted(set(raw) - {"target", "fusions", "report", "keep_logits", "cache_grad", "memory_budget",
                                "offload", "max_memory_gib", "cuda_graphs", "plan"})
    if unknown:
        raise OptionError(f"unknown graphopt option(s) {unknown}; {_describe_valid(fusion_names)}")

    target = raw.get("target", "auto")
    if target not in TARGETS:
        raise OptionError(f"target={target!r} is not one of {', '.join(TARGETS)}")

    fusions = raw.get("fusions", None)
    if fusions is None:
        enabled = set(fusion_names)
    elif isinstance(fusions, dict):
        _check_names(fusions, fusion_names)
        for name, on in fusions.items():
            if not isinstance(on, bool):
                raise OptionError(f"fusions[{name!r}] must be True or False, got {on!r}")
        enabled = {n for n in fusion_names if fusions.get(n, True)}
    elif isinstance(fusions, (list, tuple, set, frozenset)):
        _check_names(fusions, fusion_names)
        enabled = set(fusions)
    else:
        raise OptionError("fusions must be a dict {name: bool} or a list of names to enable; "
                          f"names: {', '.join(fusion_names)}")

    report = raw.get("report")
    if report is not None:
        report = Path(report)
        if report.suffix not in REPORT_SUFFIXES:
            raise OptionError(f"report={str(report)!r}: the path must end in {', '.join(REPORT_SUFFIXES)}")
        folder = report.parent.resolve()
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise OptionError(f"report={str(report)!r}: the folder {str(folder)!r} "
                              f"{'is not writable' if folder.is_dir() else 'does not exist'}; create it first")
    keep_logits, cache_grad = raw.get("keep_logits", False), raw.get("cache_grad", False)
    if not isinstance(keep_logits, bool):
        raise OptionError(f"keep_logits must be True or False, got {keep_logits!r}")
    if not isinstance(cache_grad, bool):
        raise OptionError(f"cache_grad must be True or False, got {cache_grad!r}")
    memory_budget, max_memory_gib = _memory_budget(raw.get("memory_budget", DEFAULT_MEMORY_BUDGET),
                                                   raw.get("max_memory_gib"))
    offload = raw.get("offload", False)
    if not isinstance(offload, bool):
        raise OptionError(f"offload must be True or False, got {offload!r}")
    cuda_graphs = raw.get("cuda_graphs", "auto")
    if not isinstance(cuda_graphs, bool) and cuda_graphs != "auto":
        raise OptionError(f"cuda_graphs must be \"auto\", True or False, got {cuda_graphs!r}")
    plan = raw.get("plan")
    if plan is not None:
        plan = _plan_directory(plan, raw)
    return Options(target=target, fusions=frozenset(enabled), report=report, keep_logits=keep_logits,
                   cache_grad=cache_grad, memory_budget=memory_budget, offload=offload, max_memory_gib=max_memory_gib,
                   cuda_graphs=cuda_graphs, plan=plan)


PLANNED = ("fusions", "keep_logits", "cache_grad", "memory_budget", "offload", "max_memory_gib", "cuda_graphs")


def _plan_directory(plan, raw) -> Path:
    """plan= names a directory graphopt.optimize wrote; the decisions it holds are not asked for again."""
    path = Path(plan).resolve()
    if not (path / "plan.json").is_file() or not (path / "manifest.json").is_file():
        raise OptionError(f"plan={str(plan)!r}: no plan.json and manifest.json there; make one with "
                          f"graphopt.optimize(model, example_inputs, DIR) or `graphopt optimize`")
    both = [name for name in PLANNED if name in raw]
    if both:
        them = "them" if len(both) > 1 else "it"
        raise OptionError(f"plan={str(plan)!r} brings its own {', '.join(both)}: leave {them} out, or make the "
                          f"plan again with the options you want")
    return path


def check_cuda_graphs(options: Options, target: str) -> None:
    """cuda_graphs=True asks for what only a GPU target has (CUDA graphs, HIP graphs on ROCm): elsewhere an error,
    not a report that says they are on."""
    if options.cuda_graphs is True and target not in ("cuda", "hip"):
        raise OptionError(f"cuda_graphs=True: the graph runs on target {target!r}, which has no CUDA graphs; leave "
                          f"cuda_graphs unset (\"auto\") or set it to False")


def cuda_graphs_decision(options: Options, lowering, dynamic: bool, training: bool) -> tuple:
    """(on, why) for one graph. "auto" turns CUDA graphs on where they were measured faster: training graphs on
    a target whose lowering says so (NVIDIA GPUs, lowering/registry.py), of static shapes (a graph of dynamic
    shapes would be recorded once per size met); offload's copies are captured with the rest. Not for
    inference graphs: every call would overwrite the last call's outputs, which evaluation loops keep (training
    graphs copy out the loss, passes/graph_pool.py)."""
    if options.cuda_graphs is True and options.offload and dynamic and training:
        return False, ("cuda_graphs=True with offload, dynamic shapes: the graph recorded for each size keeps the "
                       "host buffers it captured, and a size recorded later can find none free (none can be pinned "
                       "during a capture); CUDA graphs off for this graph, offload kept")
    if options.cuda_graphs != "auto":
        return options.cuda_graphs, f"cuda_graphs={options.cuda_graphs}"
    if not lowering.cuda_graphs:
        return False, f"cuda_graphs=\"auto\", target {lowering.target}: CUDA graphs measured faster on NVIDIA GPUs only"
    if not training:
        return False, "cuda_graphs=\"auto\", no backward: each call would overwrite the outputs of the last"
    if dynamic:
        return False, "cuda_graphs=\"auto\", dynamic shapes: a CUDA graph would be recorded for every size met"
    return True, "cuda_graphs=\"auto\": static shapes on an NVIDIA GPU"


def _memory_budget(budget, max_memory_gib):
    if budget == "auto":
        if max_memory_gib is None:  # sized to the weights the graph reads (passes/recompute.py WEIGHTS_MULTIPLE)
            return "auto", None
        if isinstance(max_memory_gib, bool) or not isinstance(max_memory_gib, (int, float)) or max_memory_gib <= 0:
            raise OptionError(f"max_memory_gib must be a positive number of GiB, the device memory the training "
                              f"step may use (e.g. 20), got max_memory_gib={max_memory_gib!r}")
        return "auto", float(max_memory_gib)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise OptionError(f"memory_budget must be a number from 0 (recompute the most) to 1 (the fastest plan), "
                          f"or \"auto\", got {budget!r}")
    if max_memory_gib is not None:
        raise OptionError(f"max_memory_gib={max_memory_gib!r} is used only with memory_budget=\"auto\"; "
                          f"with memory_budget={budget!r} leave it out")
    return float(budget), None


def _check_names(names, fusion_names):
    bad = sorted(set(names) - set(fusion_names))
    if bad:
        raise OptionError(f"unknown fusion(s) {bad}; known fusions: {', '.join(fusion_names)}")
