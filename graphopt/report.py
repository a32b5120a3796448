"""The fusion report: what every stage of the pipeline recorded, readable by a person and by a program.

One Report per compiled graph (a model with graph breaks compiles several). `graphopt.last_report()` returns
the most recent; `graphopt.reports()` all of this process's, in order. JSON schema: docs/report-schema.md.
"""

import html
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

SCHEMA_VERSION = 1


@dataclass
class Record:
    """One fusion or one miss: what matched (or failed to), where in the model and the source, at what type."""

    pattern: str
    module: str
    source: str
    dtype: str
    shape: list
    reason: Optional[str] = None


@dataclass
class LoweringRecord:
    """How one graphopt op runs on the chosen target, and how many nodes of it the graph holds."""

    op: str
    count: int
    implementation: str
    note: Optional[str] = None


@dataclass
class Report:
    graph: int
    target: str = ""
    nodes_captured: int = 0
    fusions: list = field(default_factory=list)
    misses: list = field(default_factory=list)
    lowering: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # plain sentences: policies applied (e.g. logits not materialized)

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "graph": self.graph,
            "target": self.target,
            "nodes_captured": self.nodes_captured,
            "fusions": [asdict(r) for r in self.fusions],
            "misses": [asdict(r) for r in self.misses],
            "lowering": [asdict(r) for r in self.lowering],
            "notes": list(self.notes),
        }

    def summary(self) -> dict:
        """{pattern: number of fusions}."""
        counts = {}
        for r in self.fusions:
            counts[r.pattern] = counts.get(r.pattern, 0) + 1
        return counts

    def to_text(self) -> str:
        lines = [f"graphopt report — graph {self.graph}, target {self.target}, {self.nodes_captured} nodes captured"]
        counts = ", ".join(f"{k} ×{v}" for k, v in self.summary().items()) or "none"
        lines.append(f"fusions ({len(self.fusions)}): {counts}")
        lines += [f"  {r.pattern:<20} {r.module:<48} {_type_text(r)}  {r.source}" for r in self.fusions]
        lines.append(f"misses ({len(self.misses)})")
        lines += [f"  {r.pattern:<20} {r.module:<48} {_type_text(r)}  {r.source}\n"
                  f"  {'':<20} why: {r.reason}" for r in self.misses]
        lines.append("lowering")
        lines += [f"  {r.op} ×{r.count} → {r.implementation}" + (f"  ({r.note})" if r.note else "")
                  for r in self.lowering]
        if self.notes:
            lines.append("notes")
            lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def to_html(self) -> str:
        def table(title, records, with_reason):
            head = "<tr><th>pattern</th><th>module</th><th>type</th><th>source</th>" + (
                "<th>reason</th>" if with_reason else "") + "</tr>"
            rows = "".join(
                "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
                    [r.pattern, r.module, _type_text(r), r.source] + ([r.reason] if with_reason else []))) + "</tr>"
                for r in records)
            return f"<h2>{title} ({len(records)})</h2><table>{head}{rows}</table>"

        lowering = "".join(
            f"<tr><td>{html.escape(r.op)}</td><td>{r.count}</td><td>{html.escape(r.implementation)}</td>"
            f"<td>{html.escape(r.note or '')}</td></tr>" for r in self.lowering)
        return (
            "<!doctype html><html><head><meta charset='utf-8'><title>graphopt report</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
            "tr:nth-child(even){background:#f2f2f2}</style></head><body>"
            f"<h1>graphopt report — graph {self.graph}, target {html.escape(self.target)}</h1>"
            f"<p>{self.nodes_captured} nodes captured</p>"
            + table("Fusions", self.fusions, False) + table("Misses", self.misses, True)
            + "<h2>Lowering</h2><table><tr><th>op</th><th>count</th><th>implementation</th><th>note</th></tr>"
            + lowering + "</table>"
            + "".join(f"<p>{html.escape(note)}</p>" for note in self.notes) + "</body></html>"
        )

    def write(self, path) -> None:
        path = Path(path)
        path.write_text(render(self, path.suffix))


def render(report, suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(report.to_json(), indent=2)
    if suffix == ".html":
        return report.to_html()
    return report.to_text() + "\n"


def _type_text(r: Record) -> str:
    return f"{r.dtype}[{', '.join(str(s) for s in r.shape)}]"


# --- where a node came from ------------------------------------------------------------------------------

_SITE = re.compile(r".*/(site|dist)-packages/")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def module_path(node: torch.fx.Node) -> str:
    """The innermost module the node was traced in, as a dotted path from the compiled root."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "<top level>"
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"\.?(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".") or "<root>"


def module_classes(node: torch.fx.Node) -> list:
    """Class names of the modules the node was traced in, outermost first."""
    return [cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
            for _, cls in (node.meta.get("nn_module_stack") or {}).values()]


def module_class(node: torch.fx.Node) -> str:
    """The innermost module's class name ("" outside any module)."""
    classes = module_classes(node)
    return classes[-1] if classes else ""


def source_location(node: torch.fx.Node) -> str:
    """file:line of the user code that produced the node (the innermost frame Dynamo recorded)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return "<unknown>"
    file, line = frames[-1]
    return f"{_SITE.sub('', file)}:{line}"


def tensor_type(node: torch.fx.Node):
    """(dtype name, shape as a list of ints or symbol names) from the node's traced value."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor):
        return "?", []
    shape = [int(s) if isinstance(s, int) else str(s) for s in value.shape]
    return str(value.dtype).replace("torch.", ""), shape


def record_for(node: torch.fx.Node, pattern: str, reason: Optional[str] = None) -> Record:
    dtype, shape = tensor_type(node)
    return Record(pattern, module_path(node), source_location(node), dtype, shape, reason)


# --- reports of this process ---------------------------------------------------------------------------

_REPORTS: list = []
_WRITTEN: dict = {}  # report path → graphs already written to it


def publish(report: Report, path=None) -> None:
    """Keep the report; with a path, write it there. Later graphs of the same path (graph breaks,
    recompiles) go beside it as <stem>.graph<N><suffix>, so no graph's report is lost."""
    _REPORTS.append(report)
    if path is None:
        return
    path = Path(path)
    earlier = _WRITTEN.get(path.resolve(), 0)
    _WRITTEN[path.resolve()] = earlier + 1
    report.write(path if earlier == 0 else path.with_name(f"{path.stem}.graph{earlier}{path.suffix}"))


def last_report() -> Report:
    if not _REPORTS:
        raise RuntimeError("graphopt has compiled nothing yet in this process: call the model compiled with "
                           "torch.compile(model, backend='graphopt') first")
    return _REPORTS[-1]


def reports() -> list:
    return list(_REPORTS)
