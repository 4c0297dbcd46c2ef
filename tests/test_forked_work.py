"""``forked_work.run_queued``: tasks run in this process and forked children, with the same results as in
one process; a child that fails, dies or hangs has its tasks run in the parent; and the planner's pool
built that way holds the same plans, in the same order, as one process builds."""
import os
import pickle
import sys
import time

import pytest
from hypothesis import given, settings

from recompute_graph import forked_work, planner
from recompute_graph.solvers import chain_dp
from strategies import cost_graphs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks only on Linux")


@pytest.fixture
def two_workers(monkeypatch):
    monkeypatch.setattr(forked_work, "available_workers", lambda: 2)


def _in_the_parent_only(parent, failure):
    """A task that fails in a child (``failure()``) and returns "ran here" in the parent, after a pause
    in which the child takes the next task."""
    def task():
        if os.getpid() != parent:
            failure()
        time.sleep(0.2)
        return "ran here"
    return task


def _raise():
    raise RuntimeError("only in the child")


@pytest.mark.parametrize("failure", [_raise, lambda: os._exit(3)], ids=["raises", "dies"])
def test_queued_tasks_a_child_lost_run_in_the_parent(two_workers, monkeypatch, failure):
    outcomes, read = [], forked_work._read

    def watched_read(child, timeout_seconds):
        outcomes.append(read(child, timeout_seconds))
        return outcomes[-1]
    monkeypatch.setattr(forked_work, "_read", watched_read)
    task = _in_the_parent_only(os.getpid(), failure)
    assert forked_work.run_queued([task] * 4) == ["ran here"] * 4
    assert outcomes == [None]  # the child failed with a task taken


def test_a_child_past_its_time_is_stopped_and_its_task_run_in_the_parent(two_workers, monkeypatch):
    monkeypatch.setattr(forked_work, "CHILD_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(forked_work, "CHILD_TIMEOUT_FACTOR", 1.0)
    task = _in_the_parent_only(os.getpid(), lambda: time.sleep(60))
    start = time.perf_counter()
    assert forked_work.run_queued([task] * 3) == ["ran here"] * 3
    assert time.perf_counter() - start < 30


def test_an_error_everywhere_is_raised_from_the_parent_and_every_child_is_stopped(two_workers, monkeypatch):
    forked, fork = [], forked_work._fork

    def recorded_fork(task):
        child = fork(task)
        forked.append(child[0])
        return child
    monkeypatch.setattr(forked_work, "_fork", recorded_fork)

    def fails():
        time.sleep(0.1)
        raise ValueError("a task's own error")
    with pytest.raises(ValueError, match="a task's own error"):
        forked_work.run_queued([fails] * 3)
    parent = os.getpid()

    def hangs_in_a_child():
        if os.getpid() != parent:
            time.sleep(60)
        raise ValueError("a task's own error")
    start = time.perf_counter()
    with pytest.raises(ValueError, match="a task's own error"):
        forked_work.run_queued([hangs_in_a_child] * 2)  # the parent's task fails: its child is stopped
    assert time.perf_counter() - start < 30
    assert len(forked) == 2
    for pid in forked:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # every child is stopped and reaped


def test_the_workers_variable_caps_the_processes(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv(forked_work.WORKERS_VARIABLE, "1")
    assert forked_work.available_workers() == 1
    parent = os.getpid()
    assert forked_work.run_queued([os.getpid, os.getpid]) == [parent, parent]
    monkeypatch.setenv(forked_work.WORKERS_VARIABLE, "3")
    assert forked_work.available_workers() == 3
    monkeypatch.delenv(forked_work.WORKERS_VARIABLE)
    assert forked_work.available_workers() == 4
    monkeypatch.setenv(forked_work.WORKERS_VARIABLE, "many")
    with pytest.raises(ValueError, match="RECOMPUTE_GRAPH_WORKERS='many'"):
        forked_work.available_workers()


def _pool_signature(pool):
    return [(s.solver, s.description, s.schedule, s.simulation) for s in pool]


@settings(max_examples=15, deadline=None)
@given(cost_graphs(max_nodes=12))
def test_the_pool_built_in_several_processes_is_the_pool_one_process_builds(graph):
    """Each group of solvers keeps what no plan of its own beats; merged in the solvers' order, the pool
    is the one a single process builds: the same plans, the same order, the same simulations."""
    def workers(count):  # the processes run_queued uses
        forked_work.available_workers = lambda: count
    original, threshold, read = forked_work.available_workers, planner.POOL_FORK_NODES, forked_work._read
    outcomes = []

    def watched_read(child, timeout_seconds):
        outcomes.append(read(child, timeout_seconds))
        return outcomes[-1]
    forked_work._read = watched_read
    try:
        workers(1)
        alone = planner._build_pool(graph, "time")
        workers(3)
        planner.POOL_FORK_NODES = 0
        together = planner._build_pool(graph, "time")
    finally:
        forked_work.available_workers = original
        planner.POOL_FORK_NODES, forked_work._read = threshold, read
    assert outcomes and all(outcome is not None for outcome in outcomes)  # the children's plans came back
    assert _pool_signature(together) == _pool_signature(alone)


def test_queued_tasks_go_to_whichever_process_is_free_and_come_back_in_order(two_workers):
    """A slow task holds one process; the other takes every quick task meanwhile (a fixed split would
    have given the slow task's process half of them)."""
    def slow():
        time.sleep(2.0)
        return os.getpid()
    results = forked_work.run_queued([slow] + [os.getpid] * 4)
    assert len(set(results[1:])) == 1 and results[1] != results[0]
    assert os.getpid() in results  # the parent took its share
    assert forked_work.run_queued([lambda k=k: k * k for k in range(7)]) == [k * k for k in range(7)]


def test_the_pools_tasks_run_heaviest_first_and_small_graphs_stay_in_one_process(monkeypatch):
    from test_schedule import chain
    orders = []
    monkeypatch.setattr(planner, "run_queued", lambda tasks: orders.append([t.args[1] for t in tasks])
                        or [task() for task in tasks])
    planner._build_pool(chain(8), "time")
    assert not orders
    planner._build_pool(chain(planner.POOL_FORK_NODES), "time")
    weights = [planner.POOL_SOLVER_WEIGHTS.get(name, 0.5) for name in orders[0]]
    assert len(orders[0]) > 2 and weights == sorted(weights, reverse=True)


def test_a_plan_pickles_compactly_and_comes_back_equal():
    from test_schedule import chain
    graph = chain(40)
    plan = chain_dp.chain_dp(graph, None)
    back = pickle.loads(pickle.dumps(plan))
    assert (back.solver, back.description, back.schedule, back.simulation) == (
        plan.solver, plan.description, plan.schedule, plan.simulation)
    ops = {"forward": back.schedule.forward_ops, "backward": back.schedule.backward_ops}
    assert all(point.op is None or point.op is ops[point.phase][point.position]
               for point in back.simulation.timeline)  # the timeline's ops are the schedule's own again
    assert any(point.op is None for point in back.simulation.timeline)
