"""The torch.compile backend: torch.compile(model, backend="graphopt", options={...}).

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so no import is needed.
"""

import logging

import torch
import transformers.utils.logging  # noqa: F401  (gives logging.Logger transformers' warning_once and info_once)

from graphopt.options import OptionError, parse_options
from graphopt.passes.registry import FUSIONS
from graphopt.pipeline import compile_graph

# transformers logs from inside model forwards through logger.warning_once (from 5.25, "use_cache=True is
# incompatible with gradient checkpointing" in every forward under gradient checkpointing). Dynamo cannot trace a
# Logger method: it gives up on the whole forward, which then runs eagerly, nothing compiled or fused. The calls
# only log, so Dynamo skips them in what it traces (the message is then not printed). warning_once alone: torch
# 2.11 sorts this set when it logs each compile's metrics, and two functions cannot be sorted (an error logged at
# every compile); transformers' forwards call no other Logger method of its own.
if hasattr(logging.Logger, "warning_once"):
    torch._dynamo.config.ignore_logging_functions.add(logging.Logger.warning_once)
# Under HF gradient checkpointing each decoder layer's forward runs inside torch.utils.checkpoint, and from
# transformers 5.25 (with its `kernels` dependency) that forward sets and resets a context variable on a global
# object. Dynamo refuses a side effect inside a checkpointed region unless told it need not be replayed when the
# backward recomputes the region; refused, it breaks the graph at every layer and nothing in it fuses. Nothing
# graphopt compiles replays it: passes/checkpoint.py inlines the regions and the memory plan recomputes instead.
torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def graphopt_backend(gm, example_inputs, options=None, mode=None):
    if mode is not None:
        raise OptionError(f"mode={mode!r}: graphopt has no modes; pass its settings as options={{...}}")
    return compile_graph(gm, example_inputs, parse_options(options or {}, FUSIONS))
