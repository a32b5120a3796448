"""The fusion report: the plan of a compiled graph (graphopt/plan.py) rendered for a person (text, HTML) or a
program (JSON), and the plans of this process.

One plan per compiled graph (a model with graph breaks compiles several). `graphopt.last_report()` returns
the most recent; `graphopt.reports()` all of this process's, in order. JSON schema: docs/report-schema.md.
"""

import html as html_text
import json
from pathlib import Path

CUDA_GRAPHS_ON = ("; the trainable parameters' gradients and the loss are copied out of the graphs' memory "
                  "pool, other outputs are overwritten by the next step: clone what you keep longer")


def text(plan) -> str:
    """The report as text: the fusions, the misses with their reasons, the lowering, the memory plan."""
    lines = [f"graphopt report — graph {plan.graph}, target {plan.target}, {plan.nodes_captured} nodes captured"]
    counts = ", ".join(f"{k} ×{v}" for k, v in plan.summary().items()) or "none"
    lines.append(f"fusions ({len(plan.fusions)}): {counts}")
    lines += [f"  {r.pattern:<20} {r.module:<48} {_type_text(r)}  {r.source}" for r in plan.fusions]
    lines.append(f"misses ({len(plan.misses)})")
    lines += [f"  {r.pattern:<20} {r.module:<48} {_type_text(r)}  {r.source}\n"
              f"  {'':<20} why: {r.reason}" for r in plan.misses]
    lines.append("lowering")
    lines += [f"  {r.op} ×{r.count} → {r.implementation}" + (f"  ({r.note})" if r.note else "")
              for r in plan.lowering]
    if plan.saved_for_backward:
        lines.append(_saved_text(plan))
        lines += _memory_lines(plan)
        offload = plan.saved_for_backward.get("offload")
        lines.append("  per layer: saved" + (" (of which offloaded)" if offload else "")
                     + " / recomputed in the backward (FLOPs of the recompute)")
        lines += [f"    {layer:<48} {_bytes_text(e['saved_bytes'])}"
                  + (f" ({_bytes_text(e.get('offloaded_bytes', 0))})" if offload else "")
                  + f" / {_bytes_text(e['recomputed_bytes'])} ({_flops_text(e['recomputed_flops'])})"
                  for layer, e in plan.saved_for_backward["per_layer"].items()]
    if plan.cuda_graphs:
        lines.append(_cuda_graphs_text(plan))
    if plan.notes:
        lines.append("notes")
        lines += [f"  {note}" for note in plan.notes]
    return "\n".join(lines)

def _cuda_graphs_text(plan) -> str:
    graphs = plan.cuda_graphs
    return (f"CUDA graphs: {'on' if graphs['on'] else 'off'} ({graphs['why']})"
            + (CUDA_GRAPHS_ON if graphs["on"] else ""))

def _memory_lines(plan) -> list:
    saved, lines = plan.saved_for_backward, []
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

def _saved_text(plan) -> str:
    saved = plan.saved_for_backward
    largest = ", ".join(f"{t['dtype']}[{', '.join(map(str, t['shape']))}] ×{t['count']}" for t in saved["largest"])
    return (f"saved for backward (memory_budget {saved['memory_budget']:g}): {saved['tensors']} activations, "
            f"{_bytes_text(saved['bytes'])} (largest: {largest}); and {saved['inputs_kept']} of the graph's "
            f"inputs (weights, ids), {_bytes_text(saved['inputs_kept_bytes'])}; recomputed in the backward: "
            f"{saved['recomputed']['ops']} ops writing {_bytes_text(saved['recomputed']['bytes'])}, "
            f"{_flops_text(saved['recomputed']['flops'])}")

def html(plan) -> str:
    """The report as one self-contained HTML page."""
    def table(title, records, with_reason):
        head = "<tr><th>pattern</th><th>module</th><th>type</th><th>source</th>" + (
            "<th>reason</th>" if with_reason else "") + "</tr>"
        rows = "".join(
            "<tr>" + "".join(f"<td>{html_text.escape(str(c))}</td>" for c in (
                [r.pattern, r.module, _type_text(r), r.source] + ([r.reason] if with_reason else []))) + "</tr>"
            for r in records)
        return f"<h2>{title} ({len(records)})</h2><table>{head}{rows}</table>"

    lowering = "".join(
        f"<tr><td>{html_text.escape(r.op)}</td><td>{r.count}</td><td>{html_text.escape(r.implementation)}</td>"
        f"<td>{html_text.escape(r.note or '')}</td></tr>" for r in plan.lowering)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>graphopt report</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
        "tr:nth-child(even){background:#f2f2f2}</style></head><body>"
        f"<h1>graphopt report — graph {plan.graph}, target {html_text.escape(plan.target)}</h1>"
        f"<p>{plan.nodes_captured} nodes captured</p>"
        + table("Fusions", plan.fusions, False) + table("Misses", plan.misses, True)
        + "<h2>Lowering</h2><table><tr><th>op</th><th>count</th><th>implementation</th><th>note</th></tr>"
        + lowering + "</table>"
        + (f"<p>{html_text.escape(_saved_text(plan))}</p>" if plan.saved_for_backward else "")
        + (f"<p>{html_text.escape(_cuda_graphs_text(plan))}</p>" if plan.cuda_graphs else "")
        + "".join(f"<p>{html_text.escape(note)}</p>" for note in plan.notes) + "</body></html>"
    )


def render(plan, suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(plan.to_json(), indent=2)
    if suffix == ".html":
        return html(plan)
    return text(plan) + "\n"


def write(plan, path) -> None:
    path = Path(path)
    path.write_text(render(plan, path.suffix))


def _bytes_text(n) -> str:
    return f"{n / 2**20:,.1f} MiB" if isinstance(n, int) else f"{n} bytes"


def _flops_text(n) -> str:
    return f"{n / 1e9:,.3f} GFLOP" if isinstance(n, int) else f"{n} FLOP"


def _type_text(r) -> str:
    return f"{r.dtype}[{', '.join(str(s) for s in r.shape)}]"


# --- the plans of this process ------------------------------------------------------------------------

_PLANS: list = []
_WRITTEN: dict = {}  # report path → graphs already written to it
_FILE_OF: dict = {}  # id(plan) → the file publish() wrote its report to


def publish(plan, path=None) -> None:
    """Keep the plan; with a path, write its report there. Later graphs of the same path (graph breaks,
    recompiles) go beside it as <stem>.graph<N><suffix>, so no graph's report is lost."""
    if path is not None:
        path = Path(path)
        earlier = _WRITTEN.get(path.resolve(), 0)
        written = path if earlier == 0 else path.with_name(f"{path.stem}.graph{earlier}{path.suffix}")
        write(plan, written)
        _WRITTEN[path.resolve()] = earlier + 1
        _FILE_OF[id(plan)] = written
    _PLANS.append(plan)


def record_measured_peak(peak_bytes: int, plan=None) -> None:
    """Put a measured peak (e.g. torch.cuda.max_memory_allocated() over training steps) beside the estimate
    in a graph's plan (default: the last one), and write its report again where it was written."""
    plan = plan or last_report()
    if not plan.saved_for_backward:
        raise RuntimeError("this graph has no backward, so no memory estimate to compare with: measure a "
                           "training step (forward and backward) of a model compiled with backend='graphopt'")
    plan.saved_for_backward["estimate"]["measured_peak_bytes"] = int(peak_bytes)
    if id(plan) in _FILE_OF:
        write(plan, _FILE_OF[id(plan)])


def last_report():
    """The plan of the graph graphopt compiled last; .to_text(), .to_html() and .to_json() render it."""
    if not _PLANS:
        raise RuntimeError("graphopt has compiled nothing yet in this process: call the model compiled with "
                           "torch.compile(model, backend='graphopt') first")
    return _PLANS[-1]


def reports() -> list:
    """The plans of every graph graphopt compiled in this process, in order."""
    return list(_PLANS)
