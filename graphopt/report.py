"""The fusion report: what every stage of the pipeline recorded, readable by a person and by a program.

One Report per compiled graph (a model with graph breaks compiles several). `graphopt.last_report()` returns
the most recent; `graphopt.reports()` all of this process's, in order. JSON schema: docs/report-schema.md.
"""

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

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


CUDA_GRAPHS_ON = ("; the trainable parameters' gradients and the loss are copied out of the graphs' memory "
                  "pool, other outputs are overwritten by the next step: clone what you keep longer")


@dataclass
class Report:
    graph: int
    target: str = ""
    nodes_captured: int = 0
    fusions: list = field(default_factory=list)
    misses: list = field(default_factory=list)
    lowering: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # plain sentences: policies applied (e.g. logits not materialized)
    # What the forward keeps for the backward, recomputes or offloads, and the estimated peak: set by the
    # partitioner when the forward compiles (docs/report-schema.md)
    saved_for_backward: Optional[dict] = None
    # {"on": bool, "why": str} where Inductor compiles the graph (graphopt/options.py cuda_graphs_decision)
    cuda_graphs: Optional[dict] = None

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
            "saved_for_backward": self.saved_for_backward,
            "cuda_graphs": self.cuda_graphs,
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
        if self.saved_for_backward:
            lines.append(self._saved_text())
            lines += self._memory_lines()
            offload = self.saved_for_backward.get("offload")
            lines.append("  per layer: saved" + (" (of which offloaded)" if offload else "")
                         + " / recomputed in the backward (FLOPs of the recompute)")
            lines += [f"    {layer:<48} {_bytes_text(e['saved_bytes'])}"
                      + (f" ({_bytes_text(e.get('offloaded_bytes', 0))})" if offload else "")
                      + f" / {_bytes_text(e['recomputed_bytes'])} ({_flops_text(e['recomputed_flops'])})"
                      for layer, e in self.saved_for_backward["per_layer"].items()]
        if self.cuda_graphs:
            lines.append(self._cuda_graphs_text())
        if self.notes:
            lines.append("notes")
            lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def _cuda_graphs_text(self) -> str:
        graphs = self.cuda_graphs
        return (f"CUDA graphs: {'on' if graphs['on'] else 'off'} ({graphs['why']})"
                + (CUDA_GRAPHS_ON if graphs["on"] else ""))

    def _memory_lines(self) -> list:
        saved, lines = self.saved_for_backward, []
        auto = saved.get("auto")
        if auto:
            tried = ", ".join(f"{t['memory_budget']:g}{' + offload' if t['offload'] else ''} → "
                              f"{_bytes_text(t['estimated_peak_bytes'])}" for t in auto["tried"])
            if auto["limit_bytes"] is None:  # no parameters to size the plan to (passes/recompute.py _limit)
                limit = "the graph reads no parameters to size the plan to: the fastest plan"
            elif auto["max_memory_gib"] is None:
                limit = (f"estimates must fit {auto['weights_multiple']:g} × the {_bytes_text(auto['weights_bytes'])} "
                         f"of parameters the graph reads, {_bytes_text(auto['limit_bytes'])}")
            else:
                limit = (f"max_memory_gib {auto['max_memory_gib']:g}: estimates must fit "
                         f"{auto['max_memory_gib'] - auto['reserve_gib']:g} GiB, {auto['reserve_gib']:g} GiB kept for "
                         f"what the graphs do not show")
            misses = ""
            if not auto["fits"] and auto["max_memory_gib"] is None:  # no limit was asked for: nothing failed
                misses = ", the leanest plan: even its estimate is over the limit, the activations dominate"
            elif not auto["fits"]:
                misses = ", the leanest plan, and it does not fit"
            lines.append(f"  memory_budget auto ({limit}): chose {saved['memory_budget']:g}"
                         f"{' with offload' if auto['offload'] else ''}{misses} (tried {tried})")
        offload = saved.get("offload")
        if offload:
            kept = "; ".join(f"{k['tensors']} {k['reason']} ({_bytes_text(k['bytes'])})" for k in offload["kept"])
            lines.append(f"  offloaded to host memory: {offload['tensors']} activations, "
                         f"{_bytes_text(offload['bytes'])}" + ("" if offload["copies_made"] else
                                                               " (planned only: the target is the host itself)")
                         + (f"; kept on the device: {kept}" if kept else ""))
        estimate = saved["estimate"]
        measured = estimate.get("measured_peak_bytes")
        lines.append(f"  estimated peak of the step: {_bytes_text(estimate['estimated_peak_bytes'])} (forward "
                     f"{_bytes_text(estimate['forward_peak_bytes'])}, backward "
                     f"{_bytes_text(estimate['backward_peak_bytes'])})"
                     + (f"; measured {_bytes_text(measured)}" if measured is not None else ""))
        if estimate.get("at_peak"):
            lines.append(f"    largest at the {estimate['at_peak'][0]['graph']} peak: " + ", ".join(
                f"{b['node']} ({b['op']}) {_bytes_text(b['bytes'])}" for b in estimate["at_peak"]))
        return lines

    def _saved_text(self) -> str:
        saved = self.saved_for_backward
        largest = ", ".join(f"{t['dtype']}[{', '.join(map(str, t['shape']))}] ×{t['count']}" for t in saved["largest"])
        return (f"saved for backward (memory_budget {saved['memory_budget']:g}): {saved['tensors']} activations, "
                f"{_bytes_text(saved['bytes'])} (largest: {largest}); and {saved['inputs_kept']} of the graph's "
                f"inputs (weights, ids), {_bytes_text(saved['inputs_kept_bytes'])}; recomputed in the backward: "
                f"{saved['recomputed']['ops']} ops writing {_bytes_text(saved['recomputed']['bytes'])}, "
                f"{_flops_text(saved['recomputed']['flops'])}")

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
            + (f"<p>{html.escape(self._saved_text())}</p>" if self.saved_for_backward else "")
            + (f"<p>{html.escape(self._cuda_graphs_text())}</p>" if self.cuda_graphs else "")
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


def _bytes_text(n) -> str:
    return f"{n / 2**20:,.1f} MiB" if isinstance(n, int) else f"{n} bytes"


def _flops_text(n) -> str:
    return f"{n / 1e9:,.3f} GFLOP" if isinstance(n, int) else f"{n} FLOP"


def _type_text(r: Record) -> str:
    return f"{r.dtype}[{', '.join(str(s) for s in r.shape)}]"


# --- reports of this process ---------------------------------------------------------------------------

_REPORTS: list = []
_WRITTEN: dict = {}  # report path → graphs already written to it
_PATH_OF: dict = {}  # id(report) → (the path asked for, the file publish() wrote it to)


def publish(report: Report, path=None) -> None:
    """Keep the report; with a path, write it there. Later graphs of the same path (graph breaks,
    recompiles) go beside it as <stem>.graph<N><suffix>, so no graph's report is lost."""
    if path is not None:
        path = Path(path)
        earlier = _WRITTEN.get(path.resolve(), 0)
        written = path if earlier == 0 else path.with_name(f"{path.stem}.graph{earlier}{path.suffix}")
        report.write(written)
        _WRITTEN[path.resolve()] = earlier + 1
        _PATH_OF[id(report)] = (path.resolve(), written)
    _REPORTS.append(report)


def withdraw(report: Report) -> None:
    """Forget the report of a graph Dynamo abandoned (it restarts its analysis and hands over another graph in
    its place): that graph's report takes this one's number and file."""
    _REPORTS.remove(report)
    key, written = _PATH_OF.pop(id(report), (None, None))
    if written is not None:
        written.unlink(missing_ok=True)
        _WRITTEN[key] -= 1


def rewrite(report: Report) -> None:
    """Write a report again where publish() wrote it, after a later stage added to it."""
    _, path = _PATH_OF.get(id(report), (None, None))
    if path is not None:
        report.write(path)


def record_measured_peak(peak_bytes: int, report: Optional[Report] = None) -> None:
    """Put a measured peak (e.g. torch.cuda.max_memory_allocated() over training steps) beside the estimate
    in a report (default: the last one), and write the report again where it was written."""
    report = report or last_report()
    if not report.saved_for_backward:
        raise RuntimeError("this graph has no backward, so no memory estimate to compare with: measure a "
                           "training step (forward and backward) of a model compiled with backend='graphopt'")
    report.saved_for_backward["estimate"]["measured_peak_bytes"] = int(peak_bytes)
    rewrite(report)


def last_report() -> Report:
    if not _REPORTS:
        raise RuntimeError("graphopt has compiled nothing yet in this process: call the model compiled with "
                           "torch.compile(model, backend='graphopt') first")
    return _REPORTS[-1]


def reports() -> list:
    return list(_REPORTS)
