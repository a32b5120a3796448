"""The plan: everything graphopt decided for one compiled graph, as plain data.

The pipeline's stages add to it in order (graphopt/pipeline.py): the options and target, the fusions and the
misses, how each graphopt op is lowered, CUDA graphs on or off, what the backward saves, recomputes or offloads.
graphopt/report.py renders it (text, HTML); to_json() and from_json() carry it to a file and back, so a saved plan
reads as it was written. JSON schema: docs/report-schema.md.
"""

from dataclasses import asdict, dataclass, field
from typing import Optional

from graphopt import report as render

SCHEMA = "graphopt.plan/1"


@dataclass
class Record:
    """One fusion or one miss: what matched (or failed to), where in the model and the source, at what type.
    key names the anchor node by module path, operation and position among that module's calls of the operation,
    so it reads the same in every process that captures the same model."""

    pattern: str
    module: str
    source: str
    dtype: str
    shape: list
    reason: Optional[str] = None
    key: str = ""


@dataclass
class LoweringRecord:
    """How one graphopt op runs on the chosen target, and how many nodes of it the graph holds."""

    op: str
    count: int
    implementation: str
    note: Optional[str] = None


@dataclass
class Plan:
    graph: int
    target: str = ""
    options: dict = field(default_factory=dict)  # as validated (graphopt/options.py Options.to_json)
    nodes_captured: int = 0
    # hashes of the graph's inputs (names, dtypes, shapes) and of its parameters alone: a saved plan is found by
    # them (graphopt/plan_dir.py)
    inputs: str = ""
    parameters: str = ""
    fusions: list = field(default_factory=list)
    misses: list = field(default_factory=list)
    lowering: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # plain sentences: policies applied (e.g. logits not materialized)
    # What the forward keeps for the backward, recomputes or offloads, and the estimated peak: the partition stage's
    # decision (passes/recompute.py; docs/report-schema.md)
    saved_for_backward: Optional[dict] = None
    # {"on": bool, "why": str} where Inductor compiles the graph (graphopt/options.py cuda_graphs_decision)
    cuda_graphs: Optional[dict] = None
    # the torch.distributed set-up it compiled in, None in one process (graphopt/distributed.py setup)
    distributed: Optional[dict] = None

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "graph": self.graph,
            "target": self.target,
            "options": dict(self.options),
            "nodes_captured": self.nodes_captured,
            "inputs": self.inputs,
            "parameters": self.parameters,
            "fusions": [asdict(r) for r in self.fusions],
            "misses": [asdict(r) for r in self.misses],
            "lowering": [asdict(r) for r in self.lowering],
            "notes": list(self.notes),
            "saved_for_backward": self.saved_for_backward,
            "cuda_graphs": self.cuda_graphs,
            "distributed": self.distributed,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        """The plan to_json() wrote; a ValueError names what is not a graphopt plan of this schema."""
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema != SCHEMA:
            raise ValueError(f"not a {SCHEMA} plan (its schema is {schema!r}): written by another graphopt version; "
                             f"make it again with this one")
        fields = {k: v for k, v in data.items() if k != "schema"}
        fields["fusions"] = [Record(**r) for r in fields.get("fusions", [])]
        fields["misses"] = [Record(**r) for r in fields.get("misses", [])]
        fields["lowering"] = [LoweringRecord(**r) for r in fields.get("lowering", [])]
        return cls(**fields)

    def summary(self) -> dict:
        """{pattern: number of fusions}."""
        counts = {}
        for r in self.fusions:
            counts[r.pattern] = counts.get(r.pattern, 0) + 1
        return counts

    def to_text(self) -> str:
        return render.text(self)

    def to_html(self) -> str:
        return render.html(self)
