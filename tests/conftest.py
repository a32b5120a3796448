"""Shared test setup, kept minimal: the Triton interpreter for CPU-only runs, Inductor's FX graph cache off, one
thread and no SIMD per xdist process on the CPU, one hypothesis profile, a fresh Dynamo for tests that compile
under their own options, and every plan a test publishes checked against docs/plan.schema.json."""

import dataclasses
import json
import os
from pathlib import Path

import torch  # does not import triton

# Must happen before anything imports triton (graphopt imports it through the CUDA lowering): without a GPU,
# Triton kernels only run on CPU tensors through the interpreter. With one they run compiled on CUDA tensors.
# setdefault: TRITON_INTERPRET set by the user wins either way.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._inductor.config  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from jsonschema import Draft202012Validator  # noqa: E402

# Each test compiles its graphs afresh: writing every compile to the cache cost the suite ~9% and served nothing
# (few tests compile the same graph), and a hit would skip the compile path a test means to exercise.
# tests/test_compile_cache.py turns it on where the cache is the subject.
torch._inductor.config.fx_graph_cache = False

# The suite is compile-bound: a process per core (pytest-xdist), tiny tensors. One thread each keeps the processes
# off each other's cores, and Inductor's C++ without SIMD (at::vec) costs gcc and the code generator less. Set in
# the environment too, so that the processes a test starts (distributed ranks, a later process reading a plan
# directory's compiled files, the demo) compile as the test's own process does: a plan directory's files are keyed
# by these settings.
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    os.environ.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_VEC_ISA_OK="0")
    torch.set_num_threads(1)
    torch._inductor.config.cpp.vec_isa_ok = False

settings.register_profile(
    "ci",
    deadline=None,  # interpreter and compile times vary a lot from example to example
    max_examples=25,
    derandomize=True,  # the same examples on every run and every machine
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after: each test compiles from scratch under its own options."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def force_offload_copies(monkeypatch):
    """Call it, and the pipeline inserts offload's copies on the CPU too, as if the CPU lowering had somewhere to
    move the data to (on the CPU they are plain copies)."""
    from graphopt.lowering import registry

    lowering_for = registry.lowering_for

    def copying(target):
        return dataclasses.replace(lowering_for(target), offload_copies=True)

    return lambda: monkeypatch.setattr(registry, "lowering_for", copying)


PLAN_SCHEMA = Draft202012Validator(json.loads((Path(__file__).parents[1] / "docs" / "plan.schema.json").read_text()))


@pytest.fixture(autouse=True)
def plans_follow_the_schema():
    """Every plan a test publishes (graphopt.reports()) is valid against the schema docs/report-schema.md
    documents."""
    import graphopt

    first = len(graphopt.reports())
    yield
    for plan in graphopt.reports()[first:]:
        PLAN_SCHEMA.validate(plan.to_json())
