"""What identifies graphopt's code in a cache key: a hash of its source files.

Inductor's FX graph cache serves a graph compiled by another process when its key matches. The key sees the
graph, its inputs and Inductor's settings, among them the partitioner's uuid (passes/recompute.py), which carries
this hash: a compile from another graphopt (another release, or an edited checkout) is never reused, since the
graphopt ops' CPU decompositions and the LoRA ops' traced launches (lowering/traced.py) are inlined into the
generated code, and the partitioner's choices are graphopt's.
"""

import functools
import hashlib
from pathlib import Path

import torch

_PACKAGES = ("graphopt", "graphopt.passes", "graphopt.lowering", "graphopt.kernels")


@functools.cache
def code_fingerprint() -> str:
    """sha256 over graphopt's Python sources (each package's files by name, then their bytes) and torch's version."""
    import importlib

    digest = hashlib.sha256(torch.__version__.encode())
    for package in _PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.glob("*.py")):
            digest.update(f"{package}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
