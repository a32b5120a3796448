"""graphopt.plan and graphopt.report: the plan, its renderings and round trip, publishing to files, and where nodes
came from."""

import json
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest

import graphopt
from graphopt import report as report_mod
from graphopt.passes import describe
from graphopt.passes.describe import module_class, module_path, node_key, source_location, tensor_type
from graphopt.plan import SCHEMA, LoweringRecord, Plan, Record
from graphopt.report import publish, render, write

LAYER0 = "base_model.model.model.layers.0.input_layernorm"
TRICKY = "model.layers.1.<post_attention>&\"norm\""


def sample_report() -> Plan:
    r = Plan(graph=3, target="cuda", nodes_captured=412, options={"memory_budget": "auto"})
    r.fusions = [
        Record("rms_norm", LAYER0, "transformers/models/llama/modeling_llama.py:71", "bfloat16", [2, "s0", 2048],
               key=f"{LAYER0}/to#0"),
        Record("rms_norm", "base_model.model.model.norm", "transformers/models/llama/modeling_llama.py:72",
               "bfloat16", [2, "s0", 2048]),
    ]
    r.misses = [
        Record("rms_norm", TRICKY, "my_model.py:10", "float32", [4, 64], reason="epsilon is not a constant & <x>"),
    ]
    r.lowering = [
        LoweringRecord("graphopt.rms_norm.default", 2, "Triton kernel kernels/rmsnorm.py:_rms_norm_forward_kernel"),
        LoweringRecord("graphopt.rms_norm_backward.default", 2, "Triton <backward>",
                       note="in the backward graph, when gradients are needed"),
    ]
    r.cuda_graphs = {"on": True, "why": 'cuda_graphs="auto": static shapes on an NVIDIA GPU'}
    return r


# --- renderings ------------------------------------------------------------------------------------------

def test_to_json_round_trips_through_json():
    data = sample_report().to_json()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {"schema", "graph", "target", "options", "nodes_captured", "inputs", "parameters", "fusions",
                         "misses", "lowering", "notes", "saved_for_backward", "cuda_graphs", "distributed"}
    assert data["cuda_graphs"] == {"on": True, "why": 'cuda_graphs="auto": static shapes on an NVIDIA GPU'}
    assert data["schema"] == SCHEMA == "graphopt.plan/1" and data["options"] == {"memory_budget": "auto"}
    assert (data["graph"], data["target"], data["nodes_captured"]) == (3, "cuda", 412)
    assert [f["module"] for f in data["fusions"]] == [LAYER0, "base_model.model.model.norm"]
    assert data["fusions"][0] == {
        "pattern": "rms_norm", "module": LAYER0, "source": "transformers/models/llama/modeling_llama.py:71",
        "dtype": "bfloat16", "shape": [2, "s0", 2048], "reason": None, "key": f"{LAYER0}/to#0",
    }
    assert data["misses"] == [{"pattern": "rms_norm", "module": TRICKY, "source": "my_model.py:10",
                               "dtype": "float32", "shape": [4, 64], "reason": "epsilon is not a constant & <x>",
                               "key": ""}]
    assert data["lowering"][1] == {"op": "graphopt.rms_norm_backward.default", "count": 2,
                                   "implementation": "Triton <backward>",
                                   "note": "in the backward graph, when gradients are needed"}


def test_the_distributed_set_up_is_in_the_summary_of_text_and_html():
    report = sample_report()
    report.distributed = {"world_size": 2, "rank": 1, "backend": "nccl", "engine": "DDP", "split": 25 * 2**20}
    line = "distributed: rank 1 of 2 (nccl), DDP: its optimizer splits the step into one graph per gradient bucket"
    assert line in report.to_text() and line in report.to_html()
    assert Plan.from_json(json.loads(json.dumps(report.to_json()))).distributed == report.distributed


def test_from_json_reads_what_to_json_wrote():
    r = sample_report()
    assert Plan.from_json(json.loads(json.dumps(r.to_json()))) == r


def test_a_compiled_graphs_plan_reads_back_as_it_renders():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8), torch.nn.Linear(8, 2))
    torch._dynamo.reset()
    try:
        torch.compile(model, backend="graphopt", options={"memory_budget": 0.5})(torch.randn(4, 8)).sum().backward()
    finally:
        torch._dynamo.reset()
    plan = graphopt.last_report()
    assert plan.saved_for_backward["memory_budget"] == 0.5 and plan.options["memory_budget"] == 0.5
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.to_text() == plan.to_text() and again.to_html() == plan.to_html()
    page = plan.to_html()  # the memory plan as the text has it: the estimate, and the per-layer table
    assert "<h2>Memory plan</h2>" in page and "estimated peak of the step" in page and "<th>saved MiB</th>" in page


@pytest.mark.parametrize("data", [{"schema_version": 1, "graph": 0}, {"schema": "graphopt.plan/0"}, []])
def test_from_json_refuses_another_schema(data):
    with pytest.raises(ValueError, match="not a graphopt.plan/1 plan.*make it again"):
        Plan.from_json(data)


def test_empty_report_renders():
    r = Plan(graph=0)
    assert r.to_json()["fusions"] == [] and r.to_json()["misses"] == []
    text = r.to_text()
    assert "fusions (0): none" in text and "misses (0)" in text
    assert "<h2>Fusions (0)</h2>" in r.to_html()


def test_summary_counts_fusions_per_pattern():
    r = sample_report()
    r.fusions.append(Record("rope", "m.rotary", "x.py:1", "float32", [1]))
    assert r.summary() == {"rms_norm": 2, "rope": 1}


def test_to_text():
    text = sample_report().to_text()
    assert "graph 3" in text and "target cuda" in text and "412 nodes captured" in text
    summary = text.split("per layer")[0]
    assert "  fusions (2): rms_norm ×2" in summary and "  misses (1): rms_norm ×1" in summary
    assert "  CUDA graphs: on" in summary
    # one line per layer, not per fused op; the misses with their sources, grouped by reason
    assert f"\n  {'base_model.model.model.layers.0':<48} rms_norm ×1\n" in text
    assert "\n  base_model.model.model.norm" in text and "\n  model.layers.1 " in text
    assert "none / missed rms_norm ×1" in text
    assert "misses (1), the most common reason first\n  rms_norm ×1, why: epsilon is not a constant & <x>" in text
    assert TRICKY in text and "float32[4, 64]  my_model.py:10" in text  # plain text: not escaped
    assert "graphopt.rms_norm.default ×2 → Triton kernel kernels/rmsnorm.py:_rms_norm_forward_kernel" in text
    assert "(in the backward graph, when gradients are needed)" in text
    assert ('CUDA graphs: on (cuda_graphs="auto": static shapes on an NVIDIA GPU); the trainable parameters\' '
            "gradients and the loss are copied out") in text


def test_misses_are_listed_the_most_common_reason_first():
    plan = Plan(graph=0)
    plan.misses = [Record("lora", f"m.layers.{i}.q_proj", "x.py:1", "float32", [1], reason=why)
                   for i, why in enumerate(["dropout", "DoRA", "DoRA", "DoRA"])]
    text = plan.to_text()
    assert text.index("lora ×3, why: DoRA") < text.index("lora ×1, why: dropout")


def test_to_html_escapes():
    page = sample_report().to_html()
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert f"<td>{LAYER0}</td>" in page
    assert "<td>model.layers.1.&lt;post_attention&gt;&amp;&quot;norm&quot;</td>" in page
    assert "rms_norm ×1: epsilon is not a constant &amp; &lt;x&gt;</th>" in page
    assert "<td>Triton &lt;backward&gt;</td>" in page
    # The raw strings never appear unescaped.
    assert "<post_attention>" not in page and "<x>" not in page and "<backward>" not in page
    assert "<h2>Fusions (2)</h2>" in page and "<h2>Misses (1), the most common reason first</h2>" in page
    assert "<p id='cuda-graphs'>CUDA graphs: on (cuda_graphs=&quot;auto&quot;: static shapes" in page


def test_to_html_escapes_target():
    page = Plan(graph=0, target="<script>").to_html()
    assert "<script>" not in page and "&lt;script&gt;" in page


@pytest.mark.parametrize("suffix", [".txt", ".json", ".html"])
def test_write(tmp_path, suffix):
    r = sample_report()
    path = tmp_path / f"report{suffix}"
    write(r, path)
    content = path.read_text(encoding="utf-8")
    assert content == render(r, suffix)
    if suffix == ".json":
        assert json.loads(content) == r.to_json()
    elif suffix == ".html":
        assert content == r.to_html()
    else:
        assert content == r.to_text() + "\n"


def test_write_accepts_str_path(tmp_path):
    path = tmp_path / "r.json"
    write(sample_report(), str(path))
    assert json.loads(path.read_text())["graph"] == 3


# --- publish / last_report --------------------------------------------------------------------------------

@pytest.fixture
def clean_reports(monkeypatch):
    monkeypatch.setattr(report_mod, "_PLANS", [])
    monkeypatch.setattr(report_mod, "_WRITTEN", {})


def test_last_report_when_nothing_compiled(clean_reports):
    with pytest.raises(RuntimeError, match="compiled nothing yet") as info:
        graphopt.last_report()
    assert "backend='graphopt'" in str(info.value)
    assert graphopt.reports() == []


def test_publish_without_path_keeps_report(clean_reports, tmp_path):
    a, b = Plan(graph=0), Plan(graph=1)
    publish(a)
    publish(b)
    assert graphopt.last_report() is b
    assert graphopt.reports() == [a, b]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".txt", ".json", ".html"])
def test_publish_same_path_twice(clean_reports, tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    first, second, third = Plan(graph=0, target="cpu"), Plan(graph=1, target="cpu"), Plan(graph=2)
    publish(first, path)
    publish(second, path)
    publish(third, path)
    assert path.read_text() == render(first, suffix)
    assert (tmp_path / f"run.graph1{suffix}").read_text() == render(second, suffix)
    assert (tmp_path / f"run.graph2{suffix}").read_text() == render(third, suffix)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"run{suffix}", f"run.graph1{suffix}", f"run.graph2{suffix}"])
    assert graphopt.last_report() is third


def test_publish_different_paths_do_not_interfere(clean_reports, tmp_path):
    publish(Plan(graph=0), tmp_path / "a.json")
    publish(Plan(graph=1), tmp_path / "b.json")
    assert json.loads((tmp_path / "a.json").read_text())["graph"] == 0
    assert json.loads((tmp_path / "b.json").read_text())["graph"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]


# --- where a node came from -------------------------------------------------------------------------------

class _FakeLayerNorm:
    pass


def fake_node(path=None, cls=_FakeLayerNorm, stack_trace=None, value=None):
    meta = {}
    if path is not None:
        meta["nn_module_stack"] = {"L__self__": ("L['self']", object), "inner": (path, cls)}
    if stack_trace is not None:
        meta["stack_trace"] = stack_trace
    if value is not None:
        meta["example_value"] = value
    return SimpleNamespace(meta=meta)


@pytest.mark.parametrize("raw,expected", [
    ("L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model'].model.layers.0.input_layernorm",
     LAYER0),
    ("L['self'].model.layers.0.input_layernorm", "model.layers.0.input_layernorm"),
    ("L['self'].model.layers[3].mlp", "model.layers.3.mlp"),
    ("L['self']._modules['model']._modules['layers']._modules['12'].self_attn", "model.layers.12.self_attn"),
    ("L['mod'].layers.0.lin", "layers.0.lin"),
    ("L['self']", "<root>"),
])
def test_module_path(raw, expected):
    assert module_path(fake_node(raw)) == expected


def test_module_path_without_stack():
    assert module_path(fake_node()) == "<top level>"
    assert module_class(fake_node()) == ""


def test_module_class():
    assert module_class(fake_node("L['self'].norm")) == "_FakeLayerNorm"
    assert module_class(fake_node("L['self'].norm", cls="transformers.models.llama.LlamaRMSNorm")) == "LlamaRMSNorm"


def test_module_path_from_real_dynamo_capture():
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(4)

        def forward(self, x):
            return self.norm(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    seen, keys = [], []

    def backend(gm, example_inputs):
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        seen.extend((module_path(n), module_class(n), source_location(n)) for n in calls)
        keys.append([node_key(n) for n in calls])
        return gm.forward

    for _ in range(2):  # two captures of the same model name their nodes alike
        torch._dynamo.reset()
        try:
            torch.compile(Model(), backend=backend)(torch.randn(2, 4))
        finally:
            torch._dynamo.reset()
    assert {(p, c) for p, c, _ in seen} == {("layers.0.norm", "RMSNorm"), ("layers.1.norm", "RMSNorm")}
    assert all(s != "<unknown>" and ":" in s for _, _, s in seen)
    assert keys[0] == keys[1] and len(set(keys[0])) == len(keys[0])
    assert keys[0][0] == "layers.0.norm/rms_norm#0"


SITE_TRACE = """  File "/home/u/train.py", line 12, in <module>
    loss = model(batch)
  File "/opt/venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py", line 71, in forward
    hidden_states = hidden_states.to(torch.float32)
"""


def test_source_location_strips_site_packages():
    assert source_location(fake_node(stack_trace=SITE_TRACE)) == "transformers/models/llama/modeling_llama.py:71"


def test_source_location_dist_packages_and_user_file():
    trace = '  File "/usr/lib/python3/dist-packages/peft/tuners/lora/layer.py", line 700, in forward\n    x\n'
    assert source_location(fake_node(stack_trace=trace)) == "peft/tuners/lora/layer.py:700"
    trace = '  File "/home/u/my_model.py", line 5, in forward\n    return x\n'
    assert source_location(fake_node(stack_trace=trace)) == "/home/u/my_model.py:5"


def test_source_location_unknown():
    assert source_location(fake_node()) == "<unknown>"
    assert source_location(fake_node(stack_trace="no frames here")) == "<unknown>"


def test_tensor_type():
    import torch
    assert tensor_type(fake_node(value=torch.empty(2, 3, dtype=torch.bfloat16))) == ("bfloat16", [2, 3])
    assert tensor_type(fake_node(value=3)) == ("?", [])


def test_record_for():
    import torch
    node = fake_node("L['self'].model.norm", stack_trace=SITE_TRACE, value=torch.empty(4, 8))
    node.op, node.target = "call_method", "to"
    node.graph = SimpleNamespace(find_nodes=lambda op, target: [node])
    rec = describe.record_for(node, "rms_norm", reason="because")
    assert rec == Record("rms_norm", "model.norm", "transformers/models/llama/modeling_llama.py:71", "float32",
                         [4, 8], "because", "model.norm/to#0")


def test_the_command_line_renders_a_saved_report(tmp_path, capsys):
    write(sample_report(), tmp_path / "r.json")
    report_mod.main([str(tmp_path / "r.json")])
    assert capsys.readouterr().out.strip() == sample_report().to_text()
    report_mod.main([str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html")])
    assert (tmp_path / "r.html").read_text() == sample_report().to_html()
    (tmp_path / "list.json").write_text(json.dumps([sample_report().to_json(), Plan(graph=4).to_json()]))
    report_mod.main([str(tmp_path / "list.json")])
    assert "graph 3" in capsys.readouterr().out
    (tmp_path / "old.json").write_text(json.dumps({"schema_version": 1}))
    with pytest.raises(SystemExit, match="old.json: not a graphopt.plan/1 plan"):
        report_mod.main([str(tmp_path / "old.json")])


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(*args):
    """Headless Chromium's stdout for args (--no-sandbox: CI runs it as root)."""
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium (Debian's chromium package, which .ci/run installs) "
                                             "is not installed")
def test_the_html_report_renders_in_chromium(tmp_path):
    """A compiled model's HTML report, as the page Chromium builds from it: the summary, the per-layer picture
    (a row per layer, a cell per op family, coloured by what happened), the memory chart (a bar per layer), the
    estimated and measured peaks, the lowering and the misses; and Chromium draws it."""
    import torch
    from models import tiny_lora_model

    torch._dynamo.reset()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    try:
        compiled = torch.compile(tiny_lora_model("llama"), backend="graphopt", options={"memory_budget": 0})
        compiled(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch._dynamo.reset()
    plan = graphopt.last_report()
    plan.misses.append(Record("rope", "base_model.model.model.layers.1.self_attn", "my_model.py:7", "float32",
                              [2, 4, 32, 16], reason="the rotation reads a table of another length"))
    report_mod.record_measured_peak(3 * 2**20, plan)
    page = tmp_path / "report.html"
    page.write_text(plan.to_html())

    dom = chromium("--dump-dom", page.as_uri())

    def element(name):
        found = re.search(rf'<(\w+)[^>]* id="{name}"', dom)
        assert found, f"no element #{name} in the page Chromium built"
        return dom[found.start():dom.index(f"</{found.group(1)}>", found.start())]

    assert "fusions (24)" in element("summary")
    layers = element("per-layer")
    assert [h for h in re.findall(r"<th>([^<]+)</th>", layers)] == [
        "layer", "RMSNorm", "RoPE", "SwiGLU / GeGLU", "LoRA", "loss"]
    rows = re.findall(r"<tr><td>([^<]+)</td>", layers)
    assert rows == [f"base_model.model.{m}" for m in ("model.layers.0", "model.layers.1", "model.norm", "lm_head")]
    assert layers.count('class="fused"') == 4 + 3 + 1 + 1 and 'class="partial"' in layers  # layer 1's RoPE
    assert layers.count('class="alone"') == 4 * 5 - 10
    chart = element("memory-chart")
    per_layer = plan.saved_for_backward["per_layer"].values()
    assert chart.count('class="recomputed"') == sum(e["recomputed_bytes"] > 0 for e in per_layer) >= 2
    assert chart.count('class="on-the-device"') == sum(e["saved_bytes"] > 0 for e in per_layer)
    assert element("peak-chart").count("<rect") == 2
    assert "graphopt.lora_linear.default" in element("lowering")
    assert "the rotation reads a table of another length" in element("misses")

    shot = tmp_path / "report.png"
    chromium(f"--screenshot={shot}", "--window-size=1100,1400", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
