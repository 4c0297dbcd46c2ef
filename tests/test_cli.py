"""The command line: recompute-graph solve (run as python -m recompute_graph, in a subprocess)."""
import json
import subprocess
import sys

import pytest

from recompute_graph.benchmark_graphs import benchmark_dir


def run(*args):
    return subprocess.run([sys.executable, "-m", "recompute_graph", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def kusumoto(name):
    return benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt"


def test_solve_with_a_budget_prints_one_json_object_on_the_last_line():
    done = run("solve", kusumoto("vgg19"), "--solver", "dp_exact", "--budget", "1.0", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("solver", "status", "budget_bytes", "feasible", "peak_bytes", "overhead", "solve_seconds"):
        assert key in result
    assert result["solver"] == "dp_exact" and result["status"] == "FEASIBLE" and result["feasible"]
    assert result["peak_bytes"] <= result["budget_bytes"]  # graph files: no planning margin
    assert result["overhead"] >= 0


def test_min_budget_is_feasible_and_a_byte_less_is_not():
    done = run("solve", kusumoto("unet"), "--solver", "dp_approx", "--min-budget", "--json")
    assert done.returncode == 0, done.stderr
    smallest = json.loads(done.stdout.splitlines()[-1])["min_budget_bytes"]
    below = run("solve", kusumoto("unet"), "--solver", "dp_approx", "--budget", smallest - 1, "--json")
    assert below.returncode == 1
    result = json.loads(below.stdout.splitlines()[-1])
    assert result["status"] == "INFEASIBLE" and result["min_budget_bytes"] == smallest


def test_memory_centric_variant_and_size_strings_are_accepted():
    done = run("solve", kusumoto("resnet50"), "--solver", "dp_exact", "--budget", "2GiB", "--variant", "memory")
    assert done.returncode == 0, done.stderr
    assert "memory-centric" in done.stdout and "2 GiB" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["solve", "missing.txt", "--budget", "0.5"], "does not exist"),
    (["solve", "KUSUMOTO", "--solver", "magic", "--budget", "0.5"], "unknown solver 'magic'"),
    (["solve", "CHECKMATE", "--solver", "dp_exact", "--budget", "0.8"], "explicit backward"),
    (["solve", "KUSUMOTO", "--solver", "evict", "--budget", "0.8"], "implicit backward"),
    (["solve", "KUSUMOTO", "--budget", "lots"], "cannot parse budget"),
])
def test_errors_are_one_line_and_exit_2(args, message):
    args = [str(kusumoto("vgg19")) if a == "KUSUMOTO" else
            str(benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json") if a == "CHECKMATE" else a
            for a in args]
    done = run(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_joint_graphs_are_solved_by_store_all_and_evict_under_auto():
    done = run("solve", str(benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json"), "--budget", "0.9",
               "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["solver"] in ("store_all", "evict") and result["peak_bytes"] <= result["budget_bytes"]


def test_argument_errors_exit_2_with_usage():
    done = run("solve", kusumoto("vgg19"), "--budget", "7.5")
    assert done.returncode == 2 and "fraction in (0, 1]" in done.stderr and "Traceback" not in done.stderr
    done = run("solve", kusumoto("vgg19"))
    assert done.returncode == 2 and "--budget" in done.stderr
    assert run("solve", "--help").returncode == 0
