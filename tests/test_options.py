"""graphopt.options.parse_options, and how option errors reach a user of torch.compile."""

import logging
from pathlib import Path

import pytest
import torch
import torch._dynamo

import graphopt
from graphopt.backend import _UnserializableConfigFilter
from graphopt.devices import resolve_target
from graphopt.options import DEFAULT_MEMORY_BUDGET, REPORT_SUFFIXES, TARGETS, OptionError, Options, parse_options
from graphopt.passes.registry import FUSIONS

NAMES = ("rms_norm", "rope", "swiglu")


# --- parse_options --------------------------------------------------------------------------------------

def test_defaults():
    opts = parse_options({}, NAMES)
    assert opts == Options(target="auto", fusions=frozenset(NAMES), report=None)
    assert isinstance(opts.fusions, frozenset)
    assert opts.cuda_graphs == "auto"


def test_defaults_enable_every_registered_fusion():
    assert parse_options({}, FUSIONS).fusions == frozenset(FUSIONS)
    assert "rms_norm" in FUSIONS


def test_option_error_is_a_value_error():
    assert issubclass(OptionError, ValueError)
    assert graphopt.OptionError is OptionError


def test_unknown_option_lists_valid_ones():
    with pytest.raises(OptionError) as info:
        parse_options({"bogus": 1, "target": "cpu"}, NAMES)
    msg = str(info.value)
    assert "bogus" in msg
    for key in ("target", "fusions", "report"):
        assert key in msg
    for target in TARGETS:
        assert target in msg
    for name in NAMES:
        assert name in msg
    for suffix in REPORT_SUFFIXES:
        assert suffix in msg


def test_several_unknown_options_are_all_named():
    with pytest.raises(OptionError, match=r"\['alpha', 'zeta'\]"):
        parse_options({"zeta": 1, "alpha": 2}, NAMES)


@pytest.mark.parametrize("target", TARGETS)
def test_valid_targets(target):
    assert parse_options({"target": target}, NAMES).target == target


@pytest.mark.parametrize("target", ["gpu", "CUDA", "", None, "xla"])
def test_bad_target(target):
    with pytest.raises(OptionError) as info:
        parse_options({"target": target}, NAMES)
    msg = str(info.value)
    assert repr(target) in msg
    assert all(t in msg for t in TARGETS)


def test_fusions_as_dict_disables_named_keeps_others():
    opts = parse_options({"fusions": {"rope": False}}, NAMES)
    assert opts.fusions == frozenset({"rms_norm", "swiglu"})
    opts = parse_options({"fusions": {"rope": True, "swiglu": False}}, NAMES)
    assert opts.fusions == frozenset({"rms_norm", "rope"})
    assert parse_options({"fusions": {n: False for n in NAMES}}, NAMES).fusions == frozenset()
    assert parse_options({"fusions": {}}, NAMES).fusions == frozenset(NAMES)


@pytest.mark.parametrize("kind", [list, tuple, set, frozenset])
def test_fusions_as_list_enables_exactly_those(kind):
    assert parse_options({"fusions": kind(["rope"])}, NAMES).fusions == frozenset({"rope"})
    assert parse_options({"fusions": kind()}, NAMES).fusions == frozenset()


@pytest.mark.parametrize("fusions", [{"rms_norm": True, "flash": False}, ["rope", "flash"]])
def test_unknown_fusion_name(fusions):
    with pytest.raises(OptionError) as info:
        parse_options({"fusions": fusions}, NAMES)
    msg = str(info.value)
    assert "flash" in msg
    assert all(n in msg for n in NAMES)


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_fusion_value_must_be_bool(value):
    with pytest.raises(OptionError, match=r"fusions\['rope'\] must be True or False"):
        parse_options({"fusions": {"rope": value}}, NAMES)


@pytest.mark.parametrize("fusions", ["rms_norm", 3, True])
def test_fusions_of_wrong_type(fusions):
    # A bare string would otherwise be read as a set of one-letter names.
    with pytest.raises(OptionError, match="fusions must be a dict"):
        parse_options({"fusions": fusions}, NAMES)


@pytest.mark.parametrize("path", ["r.txt", "out/report.json", Path("a/b.html")])
def test_report_path_accepted(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for folder in ("out", "a"):
        (tmp_path / folder).mkdir()
    assert parse_options({"report": path}, NAMES).report == Path(path)


def test_report_path_in_a_missing_folder_is_an_error_before_any_report(tmp_path, fresh_dynamo):
    before = len(graphopt.reports())
    err = _first_call_error(options={"report": str(tmp_path / "missing" / "r.html")})
    assert "OptionError" in str(err) and "does not exist" in str(err) and "missing" in str(err)
    assert len(graphopt.reports()) == before


@pytest.mark.parametrize("path", ["report", "report.md", "report.json.gz", "report.HTML"])
def test_report_path_bad_suffix(path):
    with pytest.raises(OptionError) as info:
        parse_options({"report": path}, NAMES)
    msg = str(info.value)
    assert path in msg
    assert all(s in msg for s in REPORT_SUFFIXES)


# --- devices.resolve_target -----------------------------------------------------------------------------

def test_resolve_target_auto_on_cpu():
    assert resolve_target("auto", [torch.randn(2), 3, torch.randn(1)]) == "cpu"
    assert resolve_target("auto", []) == "cpu"
    assert resolve_target("cpu", [torch.randn(2)]) == "cpu"


def test_resolve_target_ignores_meta_tensors():
    assert resolve_target("auto", [torch.empty(2, device="meta"), torch.randn(2)]) == "cpu"


@pytest.mark.parametrize("requested", ["cuda", "hip", "npu", "mps"])
def test_requested_target_does_not_match_cpu_tensors(requested):
    with pytest.raises(OptionError) as info:
        resolve_target(requested, [torch.randn(2, 3)])
    msg = str(info.value)
    assert repr(requested) in msg and "'cpu'" in msg and "target='auto'" in msg


# --- through torch.compile ------------------------------------------------------------------------------

def _first_call_error(**compile_kwargs):
    model = torch.compile(torch.nn.Linear(4, 4), backend="graphopt", **compile_kwargs)
    with pytest.raises(Exception) as info:  # noqa: PT011  (Dynamo wraps the backend's error)
        model(torch.randn(2, 4))
    return info.value


def test_compile_unknown_option(fresh_dynamo):
    err = _first_call_error(options={"bogus": 1})
    assert isinstance(err, torch._dynamo.exc.BackendCompilerFailed)
    msg = str(err)
    assert "OptionError" in msg and "bogus" in msg
    assert "valid options" in msg and "target=" in msg and "fusions=" in msg and "report=" in msg


def test_compile_mode_is_refused_clearly(fresh_dynamo):
    err = _first_call_error(mode="max-autotune")
    msg = str(err)
    assert isinstance(err, torch._dynamo.exc.BackendCompilerFailed)
    assert "mode='max-autotune'" in msg and "options=" in msg


def test_compile_target_cuda_on_cpu_tensors(fresh_dynamo):
    err = _first_call_error(options={"target": "cuda"})
    msg = str(err)
    assert isinstance(err, torch._dynamo.exc.BackendCompilerFailed)
    assert "target='cuda'" in msg and "'cpu'" in msg


def test_cuda_graphs_on_a_target_without_them_is_an_error_before_any_report(fresh_dynamo):
    before = len(graphopt.reports())
    err = _first_call_error(options={"cuda_graphs": True})
    assert "OptionError" in str(err) and "cuda_graphs=True" in str(err) and "'cpu'" in str(err)
    assert len(graphopt.reports()) == before


@pytest.mark.parametrize("budget", [0, 0.3, 1])
def test_memory_budget_accepts_zero_to_one(budget):
    assert parse_options({"memory_budget": budget}, NAMES).memory_budget == budget
    assert parse_options({}, NAMES).memory_budget == DEFAULT_MEMORY_BUDGET


@pytest.mark.parametrize("budget", [-0.1, 1.5, "fast", True, None])
def test_memory_budget_outside_zero_to_one_is_an_error(budget):
    with pytest.raises(OptionError, match="memory_budget must be a number from 0"):
        parse_options({"memory_budget": budget}, NAMES)


def test_auto_memory_budget_takes_the_memory_limit_or_none():
    options = parse_options({"memory_budget": "auto", "max_memory_gib": 20}, NAMES)
    assert (options.memory_budget, options.max_memory_gib) == ("auto", 20.0)
    options = parse_options({"memory_budget": "auto"}, NAMES)  # sized to the weights
    assert (options.memory_budget, options.max_memory_gib) == ("auto", None)


@pytest.mark.parametrize("limit", [0, -3, "20", True])
def test_auto_memory_budget_with_an_invalid_limit_is_an_error(limit):
    with pytest.raises(OptionError, match="max_memory_gib must be a positive number of GiB"):
        parse_options({"memory_budget": "auto", "max_memory_gib": limit}, NAMES)


def test_memory_limit_without_auto_is_an_error():
    with pytest.raises(OptionError, match='max_memory_gib=20 is used only with memory_budget="auto"'):
        parse_options({"memory_budget": 0.5, "max_memory_gib": 20}, NAMES)


@pytest.mark.parametrize("offload", [True, False])
def test_offload_takes_a_bool(offload):
    assert parse_options({"offload": offload}, NAMES).offload is offload
    assert parse_options({}, NAMES).offload is False


@pytest.mark.parametrize("offload", ["yes", 1, None])
def test_offload_that_is_not_a_bool_is_an_error(offload):
    with pytest.raises(OptionError, match="offload must be True or False"):
        parse_options({"offload": offload}, NAMES)


@pytest.mark.parametrize("on", [True, False])
def test_cuda_graphs_reach_inductor(on, fresh_dynamo, monkeypatch):
    """cuda_graphs=True compiles with Inductor's CUDA graph trees on, and graph partitions around the offload
    copies, for the forward and for the backward, which aot_autograd compiles at its first run, after the
    backend returned (with only the forward's settings, the backward's host tensors made Inductor skip its CUDA
    graphs); off, Inductor's own setting is left as it is. The graph is taken for a CUDA one (on CPU tensors,
    Inductor then skips the CUDA graphs it was asked for)."""
    import graphopt.pipeline
    from torch._inductor.custom_graph_pass import CustomGraphPass

    monkeypatch.setattr(graphopt.pipeline, "resolve_target", lambda requested, inputs: "cuda")

    seen = []

    class Spy(CustomGraphPass):  # Inductor runs it in each graph's compile, under that compile's settings
        def __call__(self, graph):
            seen.append((torch._inductor.config.triton.cudagraphs, torch._inductor.config.graph_partition))

        def uuid(self):
            return None

    assert parse_options({"cuda_graphs": on}, NAMES).cuda_graphs is on
    with torch._inductor.config.patch(post_grad_custom_post_pass=Spy()):
        compiled = torch.compile(torch.nn.Linear(4, 4), backend="graphopt", options={"cuda_graphs": on})
        loss = compiled(torch.randn(2, 4)).sum()
        assert len(seen) == 1  # the forward
        loss.backward()
    assert len(seen) == 2 and all(cudagraphs is on for cudagraphs, _ in seen)
    if on:
        assert all(partition for _, partition in seen)
    assert torch._inductor.config.triton.cudagraphs is False


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_every_cuda_graphs_choice_takes_offload(value):
    """The copies to host memory are captured in the CUDA graphs with the rest of the step (lowering/transfer.py)."""
    options = parse_options({"cuda_graphs": value, "offload": True}, NAMES)
    assert options.offload and options.cuda_graphs == value


@pytest.mark.parametrize("value", [1, "yes", None])
def test_cuda_graphs_must_be_auto_or_a_bool(value):
    with pytest.raises(OptionError, match='cuda_graphs must be "auto", True or False'):
        parse_options({"cuda_graphs": value}, NAMES)


# --- the backend's settings of torch -------------------------------------------------------------------------------

def test_compile_metrics_filter_drops_only_the_config_serialization_traceback():
    """Where torch cannot serialize Dynamo's config for its compile metrics (torch 2.11: the logging function graphopt
    asks Dynamo to skip), the backend drops that traceback, and nothing else that logger says."""
    def record(error):
        try:
            raise error
        except Exception as raised:
            info = (type(raised), raised, raised.__traceback__)
        return logging.LogRecord("torch._dynamo.metrics_context", logging.ERROR, __file__, 1, "metrics", None, info)

    drop = _UnserializableConfigFilter()
    assert not drop.filter(record(TypeError("Object of type _lru_cache_wrapper is not JSON serializable")))
    assert drop.filter(record(TypeError("unsupported operand")))
    assert drop.filter(record(ValueError("is not JSON serializable")))
    assert drop.filter(logging.LogRecord("x", logging.ERROR, __file__, 1, "no exception", None, None))
