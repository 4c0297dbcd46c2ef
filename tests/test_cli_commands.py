"""The product commands of ``recompute-graph``: plan and plot, and one-line errors for bad arguments."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recompute_graph import RecomputePlan
from recompute_graph.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recompute_graph", *args], capture_output=True, text=True,
                          timeout=300)


def test_plan_prints_a_summary_and_writes_a_plan_that_loads(tmp_path, capsys):
    path = tmp_path / "mlp.json"
    code = main(["plan", "mlp", "--preset", "tiny", "--budget", "0.9", "--timing", "flops", "-o", str(path), "-q"])
    out = capsys.readouterr().out
    assert code == 0
    assert "RecomputePlan" in out and "predicted peak" in out and str(path) in out
    plan = RecomputePlan.load(str(path))
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_plan_json_reports_the_plan_and_its_file(tmp_path, capsys):
    path = tmp_path / "unet.json"
    code = main(["plan", "unet", "--preset", "tiny", "--budget", "0.6", "--solver", "dp_exact", "--timing", "flops",
                 "-o", str(path), "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["feasible"] and result["solver"] == "dp_exact"
    assert result["predicted_peak_bytes"] <= result["budget_bytes"] < result["store_all_peak_bytes"]
    assert result["plan_file"] == str(path) and path.exists()
    assert result["recomputed_nodes"] > 0


def test_the_readme_plan_command_fits_resnet50_in_three_tenths_of_its_store_all_step(tmp_path, capsys):
    """The README's ``recompute-graph plan resnet50 --budget 0.3`` at the default (small) preset."""
    path = tmp_path / "resnet50.json"
    code = main(["plan", "resnet50", "--budget", "0.3", "-o", str(path), "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["feasible"]
    assert result["predicted_peak_bytes"] <= result["budget_bytes"]
    assert result["predicted_peak_bytes"] <= 0.3 * result["store_all_peak_bytes"]
    assert RecomputePlan.load(str(path)).predicted_peak_bytes == result["predicted_peak_bytes"]


def test_plan_with_an_infeasible_budget_exits_1_and_names_the_smallest_budget(tmp_path, capsys):
    code = main(["plan", "mlp", "--preset", "tiny", "--budget", "1KiB", "--timing", "flops",
                 "-o", str(tmp_path / "x.json"), "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and result["status"] == "INFEASIBLE" and result["min_budget_bytes"] > 1024
    assert not (tmp_path / "x.json").exists()


def test_plan_accepts_a_module_factory(tmp_path, capsys):
    code = main(["plan", "models_zoo:get_model", "--size", "name=mlp", "--size", "preset=tiny", "--budget", "0.9",
                 "--timing", "flops", "-o", str(tmp_path / "f.json"), "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["model"] == "get_model" and result["feasible"]


def test_plot_writes_the_three_plots_in_png_and_svg(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code = main(["plot", "unet", "--preset", "tiny", "--fractions", "0.5", "1.0", "--timing", "flops",
                 "--out-dir", str(tmp_path), "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    files = [f for paths in result["files"].values() for f in paths]
    assert sorted(kind for kind in result["files"]) == ["pareto", "strategy", "timeline"]
    assert len(files) == 6 and all((tmp_path / f.split("/")[-1]).stat().st_size > 1000 for f in files)
    # the measured timeline's peak is within 10 % of the prediction
    assert abs(result["measured_peak_bytes"] - result["predicted_peak_bytes"]) <= 0.1 * result["predicted_peak_bytes"]


def test_compare_runs_every_solver_on_graph_files_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from recompute_graph.benchmark_graphs import benchmark_dir
    checkmate = benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json"
    kusumoto = benchmark_dir() / "kusumoto2019" / "cg_vgg19.txt"
    plot = tmp_path / "compare.png"
    code = main(["compare", str(checkmate), str(kusumoto), "--fractions", "0.9", "--solvers", "evict", "chen_greedy",
                 "--plot", str(plot), "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and plot.stat().st_size > 1000
    rows = {(row["graph"], row["solver"]): row for row in result["rows"]}
    assert rows[("VGG16_256_224x224_train", "evict")]["extra_compute"] > 0
    assert ("vgg19", "chen_greedy") in rows
    # a solver that does not take a graph kind is reported, not fatal
    assert rows[("vgg19", "evict")]["extra_compute"] is None and "takes no" in rows[("vgg19", "evict")]["note"]


@pytest.mark.parametrize("args, message", [
    (["plan", "resnet9000", "--budget", "0.5"], "unknown model 'resnet9000'"),
    (["plan", "mlp", "--budget", "0.5", "--solver", "magic"], "unknown solver 'magic'"),
    (["plan", "mlp", "--budget", "lots"], "cannot parse budget 'lots'"),
    (["plan", "mlp", "--budget", "1.5"], "a float must be a fraction"),
    (["plan", "no_such_module:build", "--budget", "0.5"], "cannot import 'no_such_module'"),
    (["solve", "/no/such/graph.json", "--solver", "dp_exact", "--budget", "0.5"], "does not exist"),
    (["plot", "mlp", "--solvers", "magic"], "unknown solver 'magic'"),
    (["frobnicate"], "invalid choice"),
    (["compare", "/no/such/graph.json"], "does not exist"),
    (["compare", "/no/such/graph.json", "--fractions", "1.5"], "fractions must lie in (0, 1]"),
    (["bench", "mlp", "--solvers", "magic"], "unknown solver 'magic'"),
])
def test_bad_arguments_give_one_error_line_and_a_non_zero_exit(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_every_command_has_help():
    for command in ("plan", "bench", "compare", "plot", "solve"):
        result = run_cli(command, "--help")
        assert result.returncode == 0 and "usage: recompute-graph " + command in result.stdout


def test_check_runs_one_planned_step_against_the_original_on_a_zoo_model_and_a_factory(capsys):
    code = main(["check", "resnet18", "--preset", "tiny", "--budget", "0.9", "--timing", "flops", "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["ok"] and result["within_budget"]
    assert result["gradient_error"] <= 1e-5 and result["buffer_mismatches"] == []
    assert abs(result["prediction_error"]) <= 0.10 and result["measured_peak_bytes"] > 0
    code = main(["check", "models_zoo.third_party:build", "--size", "name=hf_gpt2", "--budget", "0.9",
                 "--timing", "flops", "-q"])
    text = capsys.readouterr().out
    assert code == 0 and "all checks pass" in text and "gradients: largest error" in text
    # an infeasible budget: exit 1, the smallest feasible budget named
    code = main(["check", "mlp", "--preset", "tiny", "--budget", "1KiB", "--timing", "flops", "--json", "-q"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and result["status"] == "INFEASIBLE" and result["min_budget_bytes"] > 1024
