"""graphopt: a torch.compile backend for LoRA fine-tuning. Use torch.compile(model, backend="graphopt")."""

from graphopt.export import ExportError, export, load
from graphopt.logits import LogitsNotMaterialized, LogitsNotMaterializedError
from graphopt.lowering import registry as _lowering  # registers the graphopt:: ops and the target kernels
from graphopt.options import OptionError, Options
from graphopt.plan import Plan, Record
from graphopt.plan_dir import optimize
from graphopt.report import last_report, record_measured_peak, reports

__version__ = "0.1.0"
__all__ = ["ExportError", "LogitsNotMaterialized", "LogitsNotMaterializedError", "OptionError", "Options", "Plan",
           "Record", "export", "last_report", "load", "optimize", "record_measured_peak", "reports", "__version__"]
