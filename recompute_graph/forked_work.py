"""Pure-Python work spread over the cores: this process and forked children take tasks from one queue.

The planner's pool runs several solvers over one cost graph, each on its own (solvers are pure Python
and never touch torch). On a large graph that is seconds per solver, and the cores beside the one
planning are idle. :func:`run_queued` forks children (``os.fork``: a child starts with the parent's
objects, the cost graph included, without pickling them); this process and each child take the next
task nobody has taken whenever they finish one, and each child sends its results back through a pipe
(pickled). A child that fails, dies or takes far longer than the parent's own share
(``CHILD_TIMEOUT_*``) is killed and its tasks run here instead, so an error surfaces as it would
without children, from this process.

The children run no torch code: only what the tasks call. Outside Linux (Windows has no ``os.fork``;
macOS's system libraries are not safe to use in a child forked from a process with threads), with one
core available (``os.sched_getaffinity``), or with ``RECOMPUTE_GRAPH_WORKERS=1``, every task runs here
in turn. The results are the same either way; only the seconds differ.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import signal
import sys
import time
import warnings
from typing import Callable, Sequence, TypeVar

__all__ = ["available_workers", "run_queued", "WORKERS_VARIABLE", "CHILD_TIMEOUT_SECONDS",
           "CHILD_TIMEOUT_FACTOR"]

T = TypeVar("T")

#: The environment variable that caps the processes (``1``: no children)
WORKERS_VARIABLE = "RECOMPUTE_GRAPH_WORKERS"
#: A child still running this long after the parent finished its own tasks, and ...
CHILD_TIMEOUT_SECONDS = 60.0
#: ... this many times the parent's tasks' seconds, is killed and its tasks run in the parent
CHILD_TIMEOUT_FACTOR = 10.0


def available_workers() -> int:
    """The processes :func:`run_queued` may use: the cores this process may run on, at most
    ``RECOMPUTE_GRAPH_WORKERS`` when set; 1 outside Linux (module docstring)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(os, "sched_getaffinity")):
        return 1
    cores = len(os.sched_getaffinity(0))
    cap = os.environ.get(WORKERS_VARIABLE, "").strip()
    if cap:
        try:
            cores = min(cores, max(1, int(cap)))
        except ValueError:
            raise ValueError(f"{WORKERS_VARIABLE}={cap!r}: give a whole number of processes (1: no children)"
                             ) from None
    return max(1, cores)


def run_queued(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """``[task() for task in tasks]`` over up to ``available_workers()`` processes, this one and forked
    children, each taking the next task nobody has taken whenever it finishes one (list scheduling:
    given the tasks heaviest first, the processes finish close together whatever the tasks' real
    costs, where a fixed split by guessed weights leaves one process waiting on another). The results
    come back in the tasks' order. A child's tasks that did not come back (it failed, died or ran past
    the timeout) run here."""
    workers = min(available_workers(), len(tasks))
    if workers < 2:
        return [task() for task in tasks]
    context = multiprocessing.get_context("fork")
    taken, lock = context.RawValue("q", 0), context.Lock()  # shared with the children: the next task

    def take_tasks() -> dict[int, T]:
        results: dict[int, T] = {}
        while True:
            with lock:
                index = taken.value
                taken.value = index + 1
            if index >= len(tasks):
                return results
            results[index] = tasks[index]()
    children = [_fork(take_tasks) for _ in range(workers - 1)]
    pending = [child for child in children if child is not None]
    try:
        start = time.perf_counter()
        results = take_tasks()
        timeout = max(CHILD_TIMEOUT_SECONDS, CHILD_TIMEOUT_FACTOR * (time.perf_counter() - start))
        for child in list(pending):
            pending.remove(child)
            outcome = _read(child, timeout)
            if outcome is not None:
                results.update(outcome[0])
        return [results[index] if index in results else tasks[index]() for index in range(len(tasks))]
    finally:  # after an error or an interrupt here, the children not read yet are stopped
        for child in pending:
            _kill(child)
            os.close(child[1])


def _fork(task: Callable[[], T]) -> tuple[int, int] | None:
    """A child running ``task``: (pid, read end of its pipe); None when the fork failed."""
    read_end, write_end = os.pipe()
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns of fork in a process with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:  # the child: run, write, leave without the parent's exit handlers or buffers
        status = 1
        try:
            os.close(read_end)
            payload = pickle.dumps(("ok", task()), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(payload)
            status = 0
        except BaseException:
            pass
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, read_end


def _read(child: tuple[int, int], timeout_seconds: float) -> tuple[T] | None:
    """The child's result as a 1-tuple, or None when it failed, died or ran past ``timeout_seconds``."""
    pid, read_end = child
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_seconds
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                _kill(child)
                return None
            chunk = os.read(read_end, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    except BaseException:  # an interrupt while waiting: the child goes too
        _kill(child)
        raise
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if status != 0 or not chunks:
        return None
    try:
        kind, result = pickle.loads(b"".join(chunks))
    except Exception:
        return None
    return (result,) if kind == "ok" else None


def _kill(child: tuple[int, int]) -> None:
    """Stop the child and reap it (its pipe is the caller's to close)."""
    pid, _ = child
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
