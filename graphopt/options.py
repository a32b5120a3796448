"""Options of torch.compile(model, backend="graphopt", options={...}), validated into one Options object."""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TARGETS = ("auto", "cuda", "hip", "npu", "mps", "cpu")
REPORT_SUFFIXES = (".txt", ".json", ".html")


class OptionError(ValueError):
    """A bad option passed to the graphopt backend."""


@dataclass(frozen=True)
class Options:
    target: str = "auto"
    fusions: frozenset = frozenset()  # names of the enabled fusions
    report: Optional[Path] = None
    keep_logits: bool = False  # materialize the logits even when the loss is fused (training with labels)
    memory_budget: float = 1.0  # 1: save what the fastest plan saves; 0: recompute the whole forward in the backward


def _describe_valid(fusion_names) -> str:
    return (f"valid options: target={'|'.join(TARGETS)}; "
            f"fusions={{name: bool}} or a list of names to enable, names: {', '.join(fusion_names)}; "
            f"report=path ending in {', '.join(REPORT_SUFFIXES)}; keep_logits=True|False; "
            f"memory_budget=a number from 0 to 1")


def parse_options(raw: dict, fusion_names) -> Options:
    fusion_names = tuple(fusion_names)
    unknown = sorted(set(raw) - {"target", "fusions", "report", "keep_logits", "memory_budget"})
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
    keep_logits = raw.get("keep_logits", False)
    if not isinstance(keep_logits, bool):
        raise OptionError(f"keep_logits must be True or False, got {keep_logits!r}")
    memory_budget = raw.get("memory_budget", 1.0)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not 0 <= memory_budget <= 1:
        raise OptionError(f"memory_budget must be a number from 0 (recompute the most) to 1 (the fastest plan), "
                          f"got {memory_budget!r}")
    return Options(target=target, fusions=frozenset(enabled), report=report, keep_logits=keep_logits,
                   memory_budget=float(memory_budget))


def _check_names(names, fusion_names):
    bad = sorted(set(names) - set(fusion_names))
    if bad:
        raise OptionError(f"unknown fusion(s) {bad}; known fusions: {', '.join(fusion_names)}")
