#!/usr/bin/env bash
# Run benchmarks/train_step.py once per variant, each in its own process (so one variant's patches, compile
# caches and memory never reach another), collect the JSON lines in one file and print the markdown table.
#
#   benchmarks/run_train_step.sh                                   all variants, default shape (1b, batch 4, seq 2048)
#   benchmarks/run_train_step.sh eager inductor -- --steps 20      some variants; arguments after -- go to train_step.py
#   benchmarks/run_train_step.sh --shape tiny --device cpu         all variants; every argument goes to train_step.py
#   benchmarks/run_train_step.sh inductor 'graphopt={"fusions": {"lora": true}}'   graphopt with options (JSON)
#   benchmarks/run_train_step.sh unsloth 'graphopt={"memory_budget": 0, "offload": true}' -- --shape 8b --batch 2
#                                                                  the lean mode against Unsloth at Llama-3-8B's shape
#
# Output: $OUT if set, else benchmarks/results: train_step-<time>.jsonl and one log per variant.
# A variant that fails is recorded in the JSON file and the table, the others still run, and the script exits 1.
# Needs graphopt installed (pip install --no-deps --no-build-isolation -e .) for its torch.compile backend, and
# liger_kernel / unsloth importable (the .site folder on PYTHONPATH) for those two variants.
# PYTHON picks the interpreter (default python3). LAUNCHER, when set, starts each variant instead of it, e.g.
#   LAUNCHER="torchrun --nproc-per-node 2" benchmarks/run_train_step.sh graphopt inductor -- --engine ddp --shape 8b
# (several GPUs, one process each: benchmarks/engines.py). RESULTS=PATH appends to that results file instead of a
# new one: the same variants run without LAUNCHER and --engine into it give the table its scaling column.
# TORCHINDUCTOR_CPP_WRAPPER=1 has Inductor generate its wrapper in C++ for the compiled variants (the table marks
# their rows).

set -u
cd "$(dirname "$0")/.."

variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ] && [ "${1#-}" = "$1" ]; do
    variants+=("$1")
    shift
done
if [ $# -gt 0 ] && [ "$1" = "--" ]; then
    shift
fi
if [ ${#variants[@]} -eq 0 ]; then
    variants=(eager inductor graphopt liger unsloth)
fi

python="${PYTHON:-python3}"
outdir="${OUT:-benchmarks/results}"
mkdir -p "$outdir"
stamp="$(date -u +%Y%m%d-%H%M%S)"
results="${RESULTS:-$outdir/train_step-$stamp.jsonl}"
failures=0

run=0
for spec in "${variants[@]}"; do
    variant="${spec%%=*}"
    options="{}"
    if [ "$spec" != "$variant" ]; then
        options="${spec#*=}"
    fi
    run=$((run + 1))
    log="$outdir/train_step-$stamp-$run-$variant.log"
    echo "=== $variant $options: ${LAUNCHER:-$python} benchmarks/train_step.py --variant $variant --options '$options' --json $results $*"
    ${LAUNCHER:-$python} benchmarks/train_step.py --variant "$variant" --options "$options" --json "$results" "$@" \
        2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    if [ "$status" -ne 0 ]; then
        echo "=== $variant FAILED with exit code $status (log: $log)"
        printf '{"variant": "%s", "failed": true, "exit_code": %d, "log": "%s", "args": "%s"}\n' \
            "$variant" "$status" "$log" "$*" >> "$results"
        failures=$((failures + 1))
    fi
done

echo
echo "results: $results"
"$python" benchmarks/train_step.py --table "$results"

if [ "$failures" -ne 0 ]; then
    echo "$failures variant(s) failed"
    exit 1
fi
