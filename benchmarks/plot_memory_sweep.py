"""Plot tokens/s against peak memory from train_step.py's JSON lines: graphopt's memory_budget sweep as a line
(each point labelled with its budget), graphopt with offload and every other variant as labelled points.

    python benchmarks/plot_memory_sweep.py RESULTS.jsonl [MORE.jsonl ...] --out benchmarks/results/sweep.png

Needs matplotlib (a benchmark dependency only).
"""

import argparse
import json


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if not r.get("failed") and r.get("peak_alloc_gib")]
    for r in rows:  # the peak compared across variants: reserved under CUDA graphs (older files: allocated only)
        r.setdefault("peak_gib", r["peak_alloc_gib"])
    return rows


def split(rows):
    """(sweep: [(budget, row)] sorted by budget, points: [(label, row)])."""
    sweep, points = [], []
    for r in rows:
        options = json.loads(r["options"]) if r.get("options") else {}
        # the budget the run used (recorded since the default became 0.6; older lines left it out: default 1)
        budget = r["memory_budget"] if r.get("memory_budget") is not None else options.get("memory_budget", 1)
        if r["variant"] == "graphopt" and set(options) <= {"memory_budget"} and isinstance(budget, (int, float)):
            sweep.append((budget, r))
        else:
            label = r["variant"] + ("" if not options else " " + ", ".join(f"{k}={v}" for k, v in options.items()))
            points.append((label, r))
    return sorted(sweep, key=lambda br: br[0]), points


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="Llama-3.2-1B shape, LoRA r=16, batch 4 × 2048, bf16, H200")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep, points = split(load(args.results))
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.plot([r["peak_gib"] for _, r in sweep], [r["tokens_per_s"] for _, r in sweep], "o-",
              color="tab:blue", label="graphopt, memory_budget 0 … 1")
    for budget, r in sweep:
        axes.annotate(f"{budget:g}", (r["peak_gib"], r["tokens_per_s"]), textcoords="offset points",
                      xytext=(4, -12), fontsize=8, color="tab:blue")
    for label, r in points:
        axes.plot(r["peak_gib"], r["tokens_per_s"], "s", color="tab:green" if "graphopt" in label else "0.3")
        axes.annotate(label, (r["peak_gib"], r["tokens_per_s"]), textcoords="offset points", xytext=(5, 4),
                      fontsize=8)
    axes.set_xlabel("peak memory (GiB): allocated, or reserved under CUDA graphs")
    axes.set_ylabel("training tokens/s")
    axes.set_title(args.title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
