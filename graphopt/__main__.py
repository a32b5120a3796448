"""Command line: `python -m graphopt demo [--steps N ...]`, `python -m graphopt doctor`, or
`python -m graphopt optimize MODEL --out DIR`, `python -m graphopt explain MODEL`, `python -m graphopt report FILE`
(also installed as `graphopt`)."""

import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "LoRA fine-tune of a tiny model through backend='graphopt', then the fusion report",
                "doctor": "this machine's device, versions, and a self-test of every graphopt op on it",
                "optimize": ("compile a model's training step once and save the plan and compiled files for reuse; "
                             "--export torch|onnx|mlir writes an inference program instead"),
                "explain": "what graphopt would do to a model (fusions, misses, memory plan), without weights or a GPU",
                "report": "render a saved report (.json) again, as text or HTML"}
    if not argv or argv[0] not in commands:
        print("usage: python -m graphopt COMMAND [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<8} {text}")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "doctor":
        from graphopt import doctor

        doctor.main(argv[1:])
    if argv[0] == "optimize":
        from graphopt import plan_dir

        return plan_dir.main(argv[1:])
    if argv[0] == "explain":
        from graphopt import explain

        return explain.main(argv[1:])
    if argv[0] == "report":
        from graphopt import report

        return report.main(argv[1:])
    from graphopt import demo

    demo.main(argv[1:])


if __name__ == "__main__":
    main()
