"""The torch.compile backend: torch.compile(model, backend="graphopt", options={...}).

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so no import is needed.
"""

from graphopt.options import OptionError, parse_options
from graphopt.passes.registry import FUSIONS
from graphopt.pipeline import compile_graph


def graphopt_backend(gm, example_inputs, options=None, mode=None):
    if mode is not None:
        raise OptionError(f"mode={mode!r}: graphopt has no modes; pass its settings as options={{...}}")
    return compile_graph(gm, example_inputs, parse_options(options or {}, FUSIONS))
