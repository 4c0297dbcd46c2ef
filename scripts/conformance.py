"""The whole conformance sweep: every third-party model, every solver, two budgets; writes docs/conformance.md.

    python scripts/conformance.py [--models NAME ...] [--solvers NAME ...] [--out docs/conformance.md] [--threads N]

For every model of ``models_zoo.third_party.CONFORMANCE_MODELS`` (torchvision, timm, transformers at small
sizes): ``models_zoo.conformance.check_model`` at 0.8 and 0.5 of the activation memory under ``auto`` and
every solver, each row one planned step against the original (gradients relative to the largest, 1e-5;
BatchNorm buffers once; allocator-measured peak within the budget; prediction within 10 %). The table has
one line per model: its floor, the ``auto`` plans' predicted/measured peaks and step-time ratios, how
many (fraction, solver) rows passed, and ``torch.utils.checkpoint`` on every block measured the same way.
Rows also go to ``docs/results/conformance_rows.md``. Models whose package is missing are listed as such.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from models_zoo import third_party  # noqa: E402
from models_zoo.conformance import check_model  # noqa: E402
from recompute_graph.units import format_bytes  # noqa: E402

SOLVERS = ("auto", "store_all", "chen_sqrt", "chen_greedy", "dp_exact", "dp_approx", "chain_dp", "revolve", "ilp")
COMMAND = "python scripts/conformance.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(third_party.CONFORMANCE_MODELS))
    parser.add_argument("--solvers", nargs="*", default=list(SOLVERS))
    parser.add_argument("--out", default="docs/conformance.md")
    parser.add_argument("--rows", default="docs/results/conformance_rows.md")
    parser.add_argument("--update", action="store_true",
                        help="rerun only --models and replace their lines in the existing pages")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1, pinned with taskset, leaves the other core to other work)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from recompute_graph.solvers import ilp
    ilp.DEFAULT_TIME_LIMIT = 8.0
    lines, row_lines, passed_models, tried = [], [], 0, 0
    start = time.perf_counter()
    for name in args.models:
        family = third_party.CONFORMANCE_MODELS[name][0]
        if not third_party.available(name):
            lines.append(f"| {name} | {family} | {family} not installed | | | | | |")
            continue
        tried += 1
        summary: dict = {}
        t0 = time.perf_counter()
        try:
            rows = check_model(name, solvers=args.solvers, time_steps=True, summary=summary)
        except Exception as error:  # noqa: BLE001 - the model itself would not build, trace or price
            lines.append(f"| {name} | {family} | FAIL: {type(error).__name__}: {str(error).splitlines()[0][:120]} "
                         "| | | | | |")
            print(f"{name}: FAIL {error}", flush=True)
            continue
        ran = [r for r in rows if not r.skipped]
        ok = all(r.passed for r in rows)
        passed_models += ok
        cells = []
        for fraction in (0.8, 0.5):
            auto = next((r for r in rows if r.solver == "auto" and r.fraction == fraction), None)
            if auto is None or auto.error:
                cells.append("error" if auto else "")
                continue
            floor = " (floor)" if auto.at_floor else ""
            ratio = f", x{auto.step_time_ratio:.2f}" if auto.step_time_ratio else ""
            cells.append(f"{auto.chosen}{floor}: {format_bytes(auto.predicted_peak_bytes)} / "
                         f"{format_bytes(auto.measured_peak_bytes)}{ratio}")
        peer = summary.get("peer", {})
        peer_cell = (f"{format_bytes(peer['measured_bytes'])} ({peer['fraction_of_store_all']:.2f}), "
                     f"x{peer['step_time_ratio']:.2f}" if peer.get("applies") else
                     f"fails: {peer.get('reason', '')[:60]}" if "reason" in peer and "Error" in peer["reason"] else "n/a")
        lines.append(f"| {name} | {family} ({summary.get('tracer', '?')}, {summary.get('nodes', 0)} nodes) | "
                     f"{'pass' if ok else 'FAIL'} | {summary.get('floor_fraction', 0):.2f} | "
                     f"{format_bytes(summary.get('store_all_measured_bytes', 0))} | {cells[0]} | {cells[1]} | "
                     f"{sum(r.passed for r in ran)}/{len(ran)} | {peer_cell} |")
        for r in rows:
            status = "skipped: " + r.skipped if r.skipped else ("pass" if r.passed else f"FAIL {r.error[:100]}")
            row_lines.append(f"| {name} | {r.fraction} | {r.solver} | {r.chosen} | {status} | {r.budget_bytes} | "
                             f"{r.predicted_peak_bytes} | {r.measured_peak_bytes} | {r.gradient_error:.1e} | "
                             f"{'x%.2f' % r.step_time_ratio if r.step_time_ratio else ''} |")
        print(f"{name}: {'pass' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f} s)", flush=True)
        for r in rows:
            if not r.passed:
                print(f"  FAIL {r.fraction} {r.solver} ({r.chosen}): error {r.error[:200]!r} grad {r.gradient_error:.1e} "
                      f"buffers {r.buffer_mismatches[:3]} measured {r.measured_peak_bytes} budget {r.budget_bytes} "
                      f"predicted {r.predicted_peak_bytes}", flush=True)
    elapsed = time.perf_counter() - start
    header = f"""# Conformance: model code nobody here wrote

Command (rewrites this page; {elapsed / 60:.0f} min on this 2-core machine, {args.threads} torch thread(s)):

```bash
{COMMAND if args.threads == 2 else f"taskset -c 0 {COMMAND} --threads {args.threads}"}
```

**{passed_models} of {tried} models pass every row** ({len(args.models) - tried} not installed here). A model
passes when, at 0.8 and 0.5 of its activation memory (parameter-gradient bytes plus that fraction of the rest
of a store-all step) and under `auto` and every solver that takes its graph, one planned step matches the
original: gradients within 1e-5 of the model's largest gradient, BatchNorm buffers updated once, the peak
measured by the allocator (`torch.profiler` memory events) within the budget and the prediction within 10 %.
A budget under a solver's floor runs at that floor ("(floor)"). The loss is the README loop's
(`losses.default_training_loss`: a model's own `loss`, else the mean square of its outputs). Sizes are in
`models_zoo/third_party.py`; the CI subset is `tests/conformance/`.

Columns: floor = the smallest feasible budget as a fraction of a store-all step's; auto at 0.8 / 0.5 = the
solver chosen, predicted / measured peak and step time against the original (fastest of 3, in turn);
rows = passing (fraction, solver) rows of those that ran; checkpoint = `torch.utils.checkpoint` on every
block (`peers.checkpoint_blocks`): measured peak (its fraction of store-all) and step time ratio. Memory is
deterministic; step times come from one run on 2 cores and move by up to ±25 % between runs (some rows of
this page were measured while the machine ran other work), so read them as indicative.

| model | family | result | floor | store-all measured | auto at 0.8 | auto at 0.5 | rows | checkpoint per block |
|---|---|---|---|---|---|---|---|---|
"""
    if args.update and os.path.exists(args.out):
        lines, row_lines = _merged(args.out, lines, args.models), _merged(args.rows, row_lines, args.models)
        results = [line.split(" | ")[2] for line in lines]
        passed_models, tried = results.count("pass"), sum(r in ("pass", "FAIL") or r.startswith("FAIL")
                                                              for r in results)
        header = header.replace(header.split("**")[1], f"{passed_models} of {tried} models pass every row")
        with open(args.out, encoding="utf-8") as f:  # the command and time of the whole sweep stay
            header = f.read().split("**")[0] + header[header.index("**"):]
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(header + "\n".join(lines) + "\n")
    os.makedirs(os.path.dirname(args.rows), exist_ok=True)
    if args.update:
        row_lines = [line for line in row_lines if line.startswith("| ") and not line.startswith("| model ")]
    with open(args.rows, "w", encoding="utf-8") as f:
        f.write(f"# Conformance rows\n\n`{COMMAND}` writes this beside docs/conformance.md.\n\n"
                "| model | fraction | solver | chosen | status | budget (B) | predicted (B) | measured (B) | "
                "grad error | time |\n|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(row_lines) + "\n")
    print(f"{passed_models}/{tried} models pass; wrote {args.out}")
    return 0 if passed_models == tried else 1


def _merged(path: str, new_lines: list[str], models: list[str]) -> list[str]:
    """The table lines of ``path`` with those of ``models`` replaced by ``new_lines`` (model order kept)."""
    with open(path, encoding="utf-8") as f:
        old = [line for line in f.read().splitlines() if line.startswith("| ") and not line.startswith("| model ")
               and not line.startswith("|---")]
    kept = [line for line in old if line.split(" | ")[0][2:] not in models
            and line.split(" | ")[0][2:] in third_party.CONFORMANCE_MODELS]
    order = list(third_party.CONFORMANCE_MODELS)
    merged = kept + new_lines
    return sorted(merged, key=lambda line: order.index(line.split(" | ")[0][2:])
                  if line.split(" | ")[0][2:] in order else len(order))


if __name__ == "__main__":
    sys.exit(main())
