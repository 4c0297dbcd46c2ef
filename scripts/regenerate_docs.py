"""Run every command whose output is a table or a plot in docs/, and keep each raw output beside the docs.

    python scripts/regenerate_docs.py --list                 # the commands, with their approximate run time
    python scripts/regenerate_docs.py [--only NAME ...] [--skip-long]

Each command's stdout goes to docs/results/NAME.md (plots go where the command says, docs/img/); the
pages quote these outputs. Times are for this 2-core CPU machine; "long" ones take over 10 minutes.
Run from the repository root with ../shared beside it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

#: (name, command, approximate minutes, page that quotes it)
COMMANDS = [
    ("predictions", "python scripts/check_predictions.py", 3, "benchmarks.md"),
    ("baselines", "python scripts/bench_baselines.py --models resnet50 resnet152 unet gpt2", 40, "benchmarks.md"),
    ("peers_resnet50", "recompute-graph bench resnet50 --preset paper --size batch=8 --fractions 0.5 0.7 "
                       "--solvers auto chen_greedy --peers "
                       "--repeats 2 -q", 12, "benchmarks.md"),
    ("peers_gpt2", "recompute-graph bench gpt2 --preset paper --size batch=2 --size seq_len=512 --fractions 0.5 0.7 "
                   "--solvers auto chen_greedy --peers --repeats 2 -q", 12, "benchmarks.md"),
    ("peers_unet", "recompute-graph bench unet --preset small --size batch=2 --size image_size=256 --size width=32 "
                   "--fractions 0.5 0.7 --solvers auto chen_greedy --peers --repeats 2 -q", 8, "benchmarks.md"),
    ("peers_resnet152", "recompute-graph bench resnet152 --preset paper --size batch=4 --fractions 0.5 0.7 "
                       "--solvers auto chen_greedy --peers "
                        "--repeats 2 -q", 20, "benchmarks.md"),
    ("plots_unet", "recompute-graph plot unet --preset small --out-dir docs/img -q", 2, "benchmarks.md"),
    ("kusumoto", "python scripts/reproduce_kusumoto.py", 10, "reproduction.md"),
    ("solver_times", "python scripts/solver_times.py", 5, "reproduction.md"),
    ("ilp_cp_sat", "python scripts/ilp_checkmate.py --graphs VGG19 vgg_unet fcn_8 segnet MobileNet ResNet50 "
                   "--fractions 0.9 0.8 --time-limit 300", 40, "benchmarks.md"),
    ("ilp_scip", "python scripts/ilp_checkmate.py --graphs VGG19 vgg_unet fcn_8 segnet MobileNet ResNet50 "
                 "--fractions 0.9 0.8 --time-limit 300 --backend scip", 25, "benchmarks.md"),
    ("ilp_large", "python scripts/ilp_checkmate.py --graphs ResNet50 random_layered_n500 random_layered_n1000 "
                  "--fractions 0.9 0.8 --time-limit 300", 12, "benchmarks.md"),
    ("ilp_vs_dp", "python scripts/ilp_vs_dp.py --zoo mlp unet resnet18 --kusumoto vgg19 --time-limit 20", 3, "ilp.md"),
    ("compare_all", "python scripts/compare_solvers.py --family kusumoto2019 checkmate2020 --zoo mlp unet resnet18 "
                    "--fractions 0.6 0.8 0.9 --time-limit 20 --plot docs/img/compare_all.png", 60, "compare.md"),
    ("compare_joint", "python scripts/compare_solvers.py --family checkmate2020 --fractions 0.6 0.8 0.9 "
                      "--time-limit 20 --pivot --plot docs/img/compare_joint.png", 30, "compare.md"),
    ("scale_meta", "python scripts/scale_meta.py", 5, "benchmarks.md"),
    ("hf_models", "python scripts/hf_models.py", 15, "training.md"),
    ("floor_resnet50", "python scripts/floor_check.py", 1, "schedules.md"),
    ("floor_resnet50_small", "python scripts/floor_check.py --preset small --budget 0.3", 1, "schedules.md"),
    ("free_tapes_timing", "python scripts/free_tapes_timing.py --size batch=8 --size image_size=64 --size width=32",
     1, "schedules.md"),
    ("free_tapes_timing_small", "python scripts/free_tapes_timing.py", 1, "schedules.md"),
    ("gruslys", "python scripts/bptt_gruslys.py --steps 1000 --batch 32 --hidden 256 --input 64 --memory 0.05",
     5, "benchmarks.md"),
    ("gruslys_200", "python scripts/bptt_gruslys.py --steps 200 --batch 32 --hidden 256 --input 64 --memory 0.12",
     1, "benchmarks.md"),
    ("gruslys_200_revolve", "python scripts/bptt_gruslys.py --steps 200 --batch 32 --hidden 256 --input 64 "
                            "--memory 0.12 --solver revolve", 1, "benchmarks.md"),
    ("gruslys_200_store_all", "python scripts/bptt_gruslys.py --steps 200 --batch 32 --hidden 256 --input 64 "
                              "--memory 1.1 --solver store_all", 1, "benchmarks.md"),
    ("executor_overhead", "python scripts/executor_overhead.py", 2, "benchmarks.md"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME")
    parser.add_argument("--skip-long", action="store_true", help="skip commands of more than 10 minutes")
    args = parser.parse_args()
    if args.list:
        for name, command, minutes, page in COMMANDS:
            print(f"{name:<16} ~{minutes:>3} min  docs/{page:<16} {command}")
        return
    unknown = set(args.only or []) - {name for name, *_ in COMMANDS}
    if unknown:
        raise SystemExit(f"unknown names {sorted(unknown)}; see --list")
    os.makedirs("docs/results", exist_ok=True)
    bin_dir = os.path.dirname(sys.executable)
    for name, command, minutes, _ in COMMANDS:
        if (args.only and name not in args.only) or (args.skip_long and minutes > 10):
            continue
        words = shlex.split(command)
        words[0] = sys.executable if words[0] == "python" else os.path.join(bin_dir, words[0])
        print(f"[{name}] {command}", flush=True)
        start = time.perf_counter()
        with open(f"docs/results/{name}.md", "w", encoding="utf-8") as out:
            out.write(f"<!-- {command} -->\n")
            out.flush()
            code = subprocess.call(words, stdout=out)
        print(f"[{name}] exit {code} after {time.perf_counter() - start:.0f} s -> docs/results/{name}.md", flush=True)


if __name__ == "__main__":
    main()
