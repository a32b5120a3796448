"""Shared test setup, kept minimal: the Triton interpreter for CPU runs and one hypothesis profile."""

import os

# Must happen before anything imports triton (graphopt imports it through the CUDA lowering): without a GPU,
# Triton kernels only run on CPU tensors through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    deadline=None,  # interpreter and compile times vary a lot from example to example
    max_examples=25,
    derandomize=True,  # the same examples on every run and every machine
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
