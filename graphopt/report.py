"""The fusion report: the plan of a compiled graph (graphopt/plan.py) rendered for a person (text, HTML) or a
program (JSON), and the plans of this process.

One plan per compiled graph (a model with graph breaks compiles several). `graphopt.last_report()` returns
the most recent; `graphopt.reports()` all of this process's, in order. JSON schema: docs/report-schema.md.
"""

import html as html_text
import json
import re
from collections import Counter
from pathlib import Path

from graphopt import distributed

CUDA_GRAPHS_ON = ("; the trainable parameters' gradients and the loss are copied out of the graphs' memory "
                  "pool, other outputs are overwritten by the next step: clone what you keep longer")


def text(plan) -> str:
    """The report as text: a summary, one line per layer, the misses in the order to fix them (the reason that
    keeps most subgraphs unfused first), the lowering, the memory plan, the notes."""
    lines = [f"graphopt report — graph {plan.graph}, target {plan.target}, {plan.nodes_captured} nodes captured",
             "summary", f"  fusions ({len(plan.fusions)}): {_counts(plan.fusions)}",
             f"  misses ({len(plan.misses)}): {_counts(plan.misses)}"]
    saved = plan.saved_for_backward
    if saved:
        offload = saved.get("offload")
        lines.append(f"  memory: estimated peak {_bytes_text(saved['estimate']['estimated_peak_bytes'])}; saved for "
                     f"the backward {_bytes_text(saved['bytes'])} ({saved['tensors']} activations), recomputed "
                     f"{saved['recomputed']['ops']} ops"
                     + (f", offloaded {_bytes_text(offload['bytes'])}" if offload else ""))
    if plan.cuda_graphs:
        lines.append(f"  CUDA graphs: {'on' if plan.cuda_graphs['on'] else 'off'}")
    if plan.distributed:
        lines.append(f"  distributed: {distributed.describe(plan.distributed)}")
    lines.append("per layer: fused / missed")
    for layer, (fused, missed) in _by_layer(plan).items():
        lines.append(f"  {layer:<48} {_counts(fused)}" + (f" / missed {_counts(missed)}" if missed else ""))
    if plan.misses:
        lines.append(f"misses ({len(plan.misses)}), the most common reason first")
        for (pattern, reason), records in _by_reason(plan.misses):
            lines.append(f"  {pattern} ×{len(records)}, why: {reason}")
            lines += [f"    {r.module:<48} {_type_text(r)}  {r.source}" for r in records]
    lines.append("lowering")
    lines += [f"  {r.op} ×{r.count} → {r.implementation}" + (f"  ({r.note})" if r.note else "")
              for r in plan.lowering]
    if saved:
        lines.append(_saved_text(plan))
        lines += _memory_lines(plan)
        offload = saved.get("offload")
        lines.append("  per layer: saved" + (" (of which offloaded)" if offload else "")
                     + " / recomputed in the backward (FLOPs of the recompute)")
        lines += [f"    {layer:<48} {_bytes_text(e['saved_bytes'])}"
                  + (f" ({_bytes_text(e.get('offloaded_bytes', 0))})" if offload else "")
                  + f" / {_bytes_text(e['recomputed_bytes'])} ({_flops_text(e['recomputed_flops'])})"
                  for layer, e in saved["per_layer"].items()]
    if plan.cuda_graphs:
        lines.append(_cuda_graphs_text(plan))
    if plan.notes:
        lines.append("notes")
        lines += [f"  {note}" for note in plan.notes]
    return "\n".join(lines)


def _counts(records) -> str:
    return ", ".join(f"{k} ×{v}" for k, v in Counter(r.pattern for r in records).items()) or "none"


_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def _by_layer(plan) -> dict:
    """{layer: (its fusions, its misses)}, a layer being the module path up to its index in a ModuleList
    (model.layers.3), or the module itself outside one, in the order the graph meets them."""
    layers = {}
    for kind, records in ((0, plan.fusions), (1, plan.misses)):
        for r in records:
            match = _LAYER.match(r.module)
            layers.setdefault(match.group(1) if match else r.module, ([], []))[kind].append(r)
    return layers


def _by_reason(misses) -> list:
    """[((pattern, reason), records)]: the misses grouped by what keeps them unfused, the largest group first."""
    groups = {}
    for r in misses:
        groups.setdefault((r.pattern, r.reason), []).append(r)
    return sorted(groups.items(), key=lambda group: -len(group[1]))


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
                     f"of parameters the graph reads (4-bit weights at their dequantized size), "
                     f"{_bytes_text(auto['limit_bytes'])}")
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
        if offload.get("prefetches_dropped"):
            lines.append(f"  {offload['prefetches_dropped']} reloads load their tensor unprefetched: each runs in a "
                         f"later captured part of the CUDA graphs than the reload that would prefetch it (the parts "
                         f"end at each copy of gradients out of their pool and each op they cannot capture)")
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


# The op families of the per-layer picture, by the pattern a fusion or miss records
FAMILIES = {"rms_norm": "RMSNorm", "rope": "RoPE", "attention": "attention", "lora": "LoRA",
            "swiglu": "SwiGLU / GeGLU", "geglu": "SwiGLU / GeGLU", "linear_cross_entropy": "loss",
            "trl_logprobs": "loss"}
_STYLE = ("body{font-family:sans-serif;margin:1.5em;color:#222}td,th{padding:2px 8px;text-align:left}"
          "table{border-collapse:collapse;margin-bottom:1em}tr:nth-child(even){background:#f4f4f4}"
          "#per-layer td{text-align:center;min-width:5em}#per-layer td:first-child{text-align:left}"
          "td.fused{background:#b7e1b0}td.missed{background:#f4b6b0}td.partial{background:#f6dc9a}"
          "td.alone{color:#999}.legend span{display:inline-block;padding:1px 8px;margin-right:6px}"
          "svg text{font-size:11px;font-family:sans-serif}")
_COLOURS = {"on the device": "#4a7fc1", "offloaded": "#9b6bc2", "recomputed": "#e8933a", "estimated": "#4a7fc1",
            "measured": "#3a9a5b"}


def family(pattern: str) -> str:
    return FAMILIES.get(pattern) or FAMILIES.get(pattern.split("_")[0]) or pattern


def html(plan) -> str:
    """The report as one self-contained HTML page (no scripts, nothing fetched): the summary, a picture of each
    layer's op families (fused, missed, left alone), the memory plan with a chart of what each layer keeps for the
    backward, the implementation each op got, the misses in the order to fix them, the notes."""
    e = html_text.escape
    summary = text(plan).split("\nper layer:")[0].splitlines()[2:]  # the text's summary lines
    body = [f"<h1>graphopt report — graph {plan.graph}, target {e(plan.target)}</h1>",
            f"<p>{plan.nodes_captured} nodes captured</p>",
            "<h2>Summary</h2><ul id='summary'>" + "".join(f"<li>{e(line.strip())}</li>" for line in summary)
            + "</ul>", _layers_html(plan)]
    if plan.saved_for_backward:
        body.append(_memory_html(plan))
    body.append("<h2>Lowering: what each op runs as</h2><table id='lowering'><tr><th>op</th><th>count</th>"
                "<th>implementation</th><th>note</th></tr>" + "".join(
                    f"<tr><td>{e(r.op)}</td><td>{r.count}</td><td>{e(r.implementation)}</td>"
                    f"<td>{e(r.note or '')}</td></tr>" for r in plan.lowering) + "</table>")
    body.append(_misses_html(plan))
    body.append(_records_html("Fusions", "fusions", plan.fusions))
    if plan.cuda_graphs:
        body.append(f"<h2>CUDA graphs</h2><p id='cuda-graphs'>{e(_cuda_graphs_text(plan))}</p>")
    if plan.notes:
        body.append("<h2>Notes</h2><ul id='notes'>" + "".join(f"<li>{e(n)}</li>" for n in plan.notes) + "</ul>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>graphopt report — graph "
            f"{plan.graph}</title><style>{_STYLE}</style></head><body>" + "".join(body) + "</body></html>")


def _layers_html(plan) -> str:
    """Layers × op families: each cell fused (green), missed (red), both (amber) or left alone (grey)."""
    e, layers = html_text.escape, _by_layer(plan)
    families = list(dict.fromkeys(family(r.pattern) for records in layers.values() for r in records[0] + records[1]))
    rows = []
    for layer, (fused, missed) in layers.items():
        cells = []
        for name in families:
            done = [r for r in fused if family(r.pattern) == name]
            left = [r for r in missed if family(r.pattern) == name]
            kind = "partial" if done and left else "fused" if done else "missed" if left else "alone"
            label = (f"{len(done)} fused" if done else "") + (" / " if done and left else "") + (
                f"{len(left)} missed" if left else "") or "—"
            why = "; ".join(dict.fromkeys(r.reason for r in left))
            cells.append(f"<td class='{kind}'" + (f" title='{e(why)}'" if why else "") + f">{label}</td>")
        rows.append(f"<tr><td>{e(layer)}</td>{''.join(cells)}</tr>")
    legend = ("<p class='legend'><span class='fused' style='background:#b7e1b0'>fused</span>"
              "<span style='background:#f6dc9a'>some missed</span><span style='background:#f4b6b0'>missed</span>"
              "<span style='color:#999'>— left alone</span> (a missed cell's tooltip says why)</p>")
    return ("<h2>Per layer</h2>" + legend + "<table id='per-layer'><tr><th>layer</th>"
            + "".join(f"<th>{e(name)}</th>" for name in families) + "</tr>" + "".join(rows) + "</table>")


def _misses_html(plan) -> str:
    """The misses grouped by what keeps them unfused, the largest group first (as the text orders them)."""
    e = html_text.escape
    groups = "".join(
        f"<tr class='reason'><th colspan='3'>{e(pattern)} ×{len(records)}: {e(reason)}</th></tr>" + "".join(
            f"<tr><td>{e(r.module)}</td><td>{e(_type_text(r))}</td><td>{e(r.source)}</td></tr>" for r in records)
        for (pattern, reason), records in _by_reason(plan.misses))
    return (f"<h2>Misses ({len(plan.misses)}), the most common reason first</h2>"
            + (f"<table id='misses'><tr><th>module</th><th>type</th><th>source</th></tr>{groups}</table>"
               if plan.misses else "<p id='misses'>none</p>"))


def _records_html(title, name, records) -> str:
    e = html_text.escape
    rows = "".join(f"<tr><td>{e(r.pattern)}</td><td>{e(r.module)}</td><td>{e(_type_text(r))}</td>"
                   f"<td>{e(r.source)}</td></tr>" for r in records)
    return (f"<h2>{title} ({len(records)})</h2><table id='{name}'><tr><th>pattern</th><th>module</th><th>type</th>"
            f"<th>source</th></tr>{rows}</table>")


def _memory_html(plan) -> str:
    """The memory plan as the text has it (what is saved, the budget decision, the estimated peak), a chart of
    each layer's activations kept for the backward (on the device, offloaded) and recomputed, the estimated
    against the measured peak, and the per-layer table."""
    saved = plan.saved_for_backward
    offload = bool(saved.get("offload"))
    head = ("<tr><th>layer</th><th>saved MiB</th>" + ("<th>offloaded MiB</th>" if offload else "")
            + "<th>recomputed MiB</th><th>recomputed GFLOP</th></tr>")
    rows = "".join(
        f"<tr><td>{html_text.escape(layer)}</td><td>{_mib(e['saved_bytes'])}</td>"
        + (f"<td>{_mib(e.get('offloaded_bytes', 0))}</td>" if offload else "")
        + f"<td>{_mib(e['recomputed_bytes'])}</td><td>{_gflop(e['recomputed_flops'])}</td></tr>"
        for layer, e in saved["per_layer"].items())
    return ("<h2>Memory plan</h2>" + "".join(f"<p>{html_text.escape(line.strip())}</p>"
                                            for line in [_saved_text(plan)] + _memory_lines(plan))
            + _memory_chart(saved) + _peak_chart(saved["estimate"]) + f"<table id='memory-table'>{head}{rows}</table>")


def _memory_chart(saved) -> str:
    """An SVG bar per layer: what it keeps for the backward (on the device, then offloaded) and, below it, what
    its backward recomputes. Sizes that are symbols (a graph of dynamic shapes) have no length to draw."""
    per_layer = saved["per_layer"]
    values = [v for e in per_layer.values() for v in (e["saved_bytes"], e["recomputed_bytes"])]
    if not per_layer or not all(isinstance(v, int) for v in values):
        return "<p id='memory-chart'>No chart: the sizes are symbolic (dynamic shapes); the table has them.</p>"
    scale, label_width, bar, row = 480 / max(max(values), 1), 230, 9, 26
    prefix = _common_prefix(list(per_layer))
    parts = [f"<text x='0' y='9'>{html_text.escape(prefix)}…</text>"] if prefix else []
    for i, (layer, e) in enumerate(per_layer.items()):
        offloaded = e.get("offloaded_bytes", 0)
        y, offloaded = 22 + i * row, offloaded if isinstance(offloaded, int) else 0
        kept = e["saved_bytes"] - offloaded
        parts.append(f"<text x='0' y='{y + 12}'>{html_text.escape(layer.removeprefix(prefix)[-36:])}</text>")
        for x, width, what, top in ((0, kept, "on the device", y), (kept, offloaded, "offloaded", y),
                                    (0, e["recomputed_bytes"], "recomputed", y + bar + 1)):
            if width:
                parts.append(f"<rect class='{what.replace(' ', '-')}' x='{label_width + x * scale:.1f}' y='{top}' "
                             f"width='{max(width * scale, 1):.1f}' height='{bar}' fill='{_COLOURS[what]}'>"
                             f"<title>{html_text.escape(layer)}: {what} {_mib(width)} MiB</title></rect>")
        parts.append(f"<text x='{label_width + 486}' y='{y + 12}'>{_mib(e['saved_bytes'])} / "
                     f"{_mib(e['recomputed_bytes'])} MiB</text>")
    legend = "".join(f"<rect x='{label_width + 130 * k}' y='0' width='10' height='10' fill='{_COLOURS[w]}'/>"
                     f"<text x='{label_width + 14 + 130 * k}' y='9'>{w}</text>"
                     for k, w in enumerate(("on the device", "offloaded", "recomputed")))
    height = 30 + len(per_layer) * row
    return (f"<h3>Activations per layer: kept for the backward, and recomputed in it</h3><svg id='memory-chart' "
            f"xmlns='http://www.w3.org/2000/svg' width='{label_width + 620}' height='{height}'>{legend}"
            + "".join(parts) + "</svg>")


def _common_prefix(names) -> str:
    """The dotted module path all module names start with (base_model.model.model.), to draw them shorter."""
    names = [n for n in names if "." in n]
    if len(names) < 2:
        return ""
    first, last = min(names), max(names)
    common = first[:next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), len(first))]
    return common[:common.rfind(".") + 1]


def _peak_chart(estimate) -> str:
    """The step's estimated peak beside the measured one (graphopt.record_measured_peak), when there is one."""
    peaks = [("estimated", estimate["estimated_peak_bytes"]), ("measured", estimate.get("measured_peak_bytes"))]
    peaks = [(what, v) for what, v in peaks if isinstance(v, int)]
    if not peaks:
        return ""
    scale = 480 / max(v for _, v in peaks)
    bars = "".join(f"<text x='0' y='{14 + 20 * i}'>{what}</text><rect class='{what}' x='80' y='{4 + 20 * i}' "
                   f"width='{max(v * scale, 1):.1f}' height='12' fill='{_COLOURS[what]}'/>"
                   f"<text x='{86 + v * scale:.1f}' y='{14 + 20 * i}'>{_bytes_text(v)}</text>"
                   for i, (what, v) in enumerate(peaks))
    return (f"<h3>Peak of the step</h3><svg id='peak-chart' xmlns='http://www.w3.org/2000/svg' width='700' "
            f"height='{10 + 20 * len(peaks)}'>{bars}</svg>")


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}" if isinstance(n, int) else html_text.escape(str(n))


def _gflop(n) -> str:
    return f"{n / 1e9:,.3f}" if isinstance(n, int) else html_text.escape(str(n))


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


def main(argv=None) -> None:
    """`graphopt report FILE.json [--html OUT | --text]`: a saved report (one plan, or the list a plan directory's
    report.json holds) rendered again."""
    import argparse

    from graphopt.plan import Plan

    parser = argparse.ArgumentParser(prog="graphopt report", description=main.__doc__.split(":")[1].strip())
    parser.add_argument("file", help="a report .json (report=\"….json\", or a plan directory's report.json)")
    parser.add_argument("--html", metavar="OUT", help="write the HTML report there instead of printing the text")
    parser.add_argument("--text", action="store_true", help="print the text report (the default)")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.file).read_text())
    try:
        plans = [Plan.from_json(d) for d in (data if isinstance(data, list) else [data])]
    except ValueError as error:
        raise SystemExit(f"{args.file}: {error}") from None
    if args.html:
        Path(args.html).write_text("\n".join(html(plan) for plan in plans))
    else:
        print("\n\n".join(text(plan) for plan in plans))


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
