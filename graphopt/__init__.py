"""graphopt: a torch.compile backend for LoRA fine-tuning. Use torch.compile(model, backend="graphopt")."""

from graphopt.logits import LogitsNotMaterialized, LogitsNotMaterializedError
from graphopt.lowering import registry as _lowering  # registers the graphopt:: ops and the target kernels
from graphopt.options import OptionError, Options
from graphopt.report import Record, Report, last_report, record_measured_peak, reports

__version__ = "0.1.0"
__all__ = ["LogitsNotMaterialized", "LogitsNotMaterializedError", "OptionError", "Options", "Record", "Report",
           "last_report", "record_measured_peak", "reports", "__version__"]
