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


class _UnserializableConfigFilter(logging.Filter):
    """Drops the traceback torch logs when its compile metrics cannot serialize Dynamo's config.

    torch 2.11 writes every compile's metrics with Dynamo's config as JSON, ignore_logging_functions included (torch
    2.13 leaves that set out), and JSON has no form for a function: each compile then logs a TypeError traceback at
    ERROR level and drops that compile's metrics. Nothing else is affected, so the traceback only alarms; it is
    dropped here, the metrics stay dropped."""

    def filter(self, record):
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, TypeError) and "is not JSON serializable" in str(error))


_config_for_logging = getattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", None)
try:
    if _config_for_logging:
        _config_for_logging()
except TypeError:
    logging.getLogger("torch._dynamo.metrics_context").addFilter(_UnserializableConfigFilter())

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
