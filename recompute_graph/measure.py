"""Measuring what really happens: peak tensor memory and time of a training step.

Budget semantics used throughout the project: *peak bytes of tensor storage allocated during one training
step (forward, loss, backward) above what was live before it (parameters, buffers, inputs); parameter
gradients count.*

Two meters implement it (``peak_memory(..., meter=...)``):

* ``"allocator"`` (the default, the meter that decides whether a plan fits): every allocation the step
  makes, those inside kernels included (mkldnn buffers, cuBLAS/cuDNN workspaces, attention scratch). On
  CPU, ``torch.profiler``'s memory events (:class:`AllocatorRecorder`); on CUDA, the caching allocator's
  own trace of allocations and frees (:func:`cuda_allocator_peak_memory`, with the 512-byte rounding of
  every block; ``torch.cuda.max_memory_allocated()`` when the trace is full). Both read the step's peak as the
  largest rise of the running total above its lowest point before it: a step that first frees what was
  allocated before it (``zero_grad(set_to_none=True)`` dropping the last step's gradients) is charged for
  what it allocates, as the plan prices it. ``max_memory_allocated()`` minus the level before the step
  would net the two (GPT-2 small on an H200: 21.6 MiB read so, 39.5 MiB allocated by the step).
* ``"storage"``: :class:`StorageTracker`, a ``TorchDispatchMode`` that registers every *new* storage an
  aten op returns (one not shared with the op's inputs) and a weak-reference finalizer that subtracts it
  when the storage dies. It sees exactly the tensors PyTorch creates, including those autograd frees in
  C++ during backward; it does not see kernel-internal scratch buffers. Storages that existed before the
  step are never counted, even if the step frees them.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import os
import re
import statistics
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["storage_key", "unique_storages", "StorageTracker", "AllocatorRecorder", "allocator_peak_memory",
           "cuda_allocator_peak_memory", "trace_peak_bytes", "peak_memory", "METERS", "saved_tensor_bytes",
           "time_step", "time_steps_in_turn", "StepTiming", "make_training_step", "default_loss", "sum_loss"]


def storage_key(tensor: torch.Tensor) -> int | None:
    """An identity for the storage behind ``tensor`` (shared by all its views), or None if it has none."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse, nested or storage-less tensor subclasses
        return None


def unique_storages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The first tensor of ``tensors`` on each distinct storage, in order."""
    seen: set[int | None] = set()
    unique = []
    for t in tensors:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            unique.append(t)
    return unique


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the mode is active.

    ``live_bytes`` / ``peak_bytes``: current and maximum sum of ``nbytes`` of live storages created under
    the mode. ``owner``: set it to any label (e.g. a graph node index) and every new storage is recorded
    in ``owner_of`` under that label while it lives. ``ops_seen`` collects the names of aten ops run
    while ``owner`` is not None (to spot random ops). Use as a context manager; nesting is allowed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.owner: Any = None
        self.owner_of: dict[int, Any] = {}
        self.ops_seen: set[str] = set()
        self._live: dict[int, int] = {}
        # a key (the storage's address) is reused by a later storage once its own is freed: the serial of
        # the storage a key names now tells a storage saved and freed from the one reusing its address
        self.serial: dict[int, int] = {}
        self._serials = itertools.count()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.owner is not None:
            self.ops_seen.add(func.overloadpacket.__name__)
        input_keys = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._register(tensor, input_keys)
        return out

    def _register(self, tensor: torch.Tensor, input_keys: set[int | None]) -> None:
        key = storage_key(tensor)
        if key is None or key in input_keys or key in self._live:
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.serial[key] = next(self._serials)
        if self.owner is not None:
            self.owner_of[key] = self.owner
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self.owner_of.pop(key, None)
        self.serial.pop(key, None)
        self.live_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


def _is_cuda(device: str | torch.device | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


METERS = ("allocator", "storage")


def peak_memory(step: Callable[[], Any], *, device: str | torch.device | None = None,
                meter: str = "allocator") -> int:
    """Peak bytes allocated while ``step()`` runs, above what was allocated before it.

    ``meter="allocator"`` (default) reads the allocator: on a CUDA ``device`` the caching allocator's
    trace (:func:`cuda_allocator_peak_memory`); elsewhere ``torch.profiler``'s memory events
    (:func:`allocator_peak_memory`), which see kernel temporaries no tensor holds (mkldnn buffers,
    attention workspaces). This is the meter that decides whether a plan fits its budget.
    ``meter="storage"`` is the :class:`StorageTracker` (tensor storages only): it attributes bytes to
    nodes but is blind to allocations inside kernels.
    """
    if meter not in METERS:
        raise ValueError(f"unknown meter {meter!r}; use one of {', '.join(METERS)}")
    if meter == "storage":
        with StorageTracker() as tracker:
            step()
        return tracker.peak_bytes
    if _is_cuda(device):
        return cuda_allocator_peak_memory(step, device)
    return allocator_peak_memory(step)


#: most allocator events a CUDA step may record (a trace of more would have lost its first events)
CUDA_TRACE_EVENTS = 4_000_000
#: the caching allocator rounds every block up to a multiple of this (``round_size``)
CUDA_BLOCK_BYTES = 512


def cuda_allocator_peak_memory(step: Callable[[], Any], device: str | torch.device) -> int:
    """Peak bytes the CUDA caching allocator hands out while ``step()`` runs on ``device``: the largest
    rise of its allocated total above the lowest point reached before it (the CPU meter's reading,
    :meth:`AllocatorRecorder.peak_bytes`), from the allocator's trace of allocations and frees
    (``torch.cuda.memory._record_memory_history`` without stack traces; a history recording already
    running is replaced), each block's bytes rounded up to the allocator's 512. A trace of
    :data:`CUDA_TRACE_EVENTS` events may have lost its first ones: then the reading is
    ``max_memory_allocated()`` minus the level before the step, which nets out what the step freed of
    earlier allocations."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    memory = torch.cuda.memory
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    memory._record_memory_history(enabled="all", context=None, max_entries=CUDA_TRACE_EVENTS, clear_history=True)
    try:
        step()
        torch.cuda.synchronize(device)
        traces = memory._snapshot()["device_traces"]
    finally:
        memory._record_memory_history(enabled=None)
    trace = traces[index] if index < len(traces) else []
    if len(trace) >= CUDA_TRACE_EVENTS:
        return int(torch.cuda.max_memory_allocated(device) - before)
    return trace_peak_bytes(trace)


def trace_peak_bytes(trace: Sequence[dict[str, Any]]) -> int:
    """The largest rise of the allocated total above its lowest point before it, over a CUDA allocator
    trace (``device_traces`` events: ``"alloc"`` adds a block, ``"free_completed"`` takes it away, each
    ``"size"`` rounded up to :data:`CUDA_BLOCK_BYTES`; other actions are ignored)."""
    running = lowest = rise = 0
    for event in trace:
        action = event["action"]
        if action not in ("alloc", "free_completed"):
            continue
        size = -(-max(event["size"], 1) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
        running += size if action == "alloc" else -size
        lowest = min(lowest, running)
        rise = max(rise, running - lowest)
    return rise


#: What the profiler writes to the process's stderr about itself: Kineto (torch 2.13's CPU build) as it
#: starts and stops, and c10's CPU allocator when a block allocated before the recording is freed in it
_PROFILER_NOTE = re.compile(rb"^(USDT:.*\] profiler_(start|stop)|\[W.*\] Memory block of unknown size was "
                            rb"allocated before the profiling started.*)\s*$")


@contextlib.contextmanager
def _profiler_notes_dropped() -> Any:
    """Kineto writes ``USDT:... profiler_start`` and ``profiler_stop`` to file descriptor 2 each time a
    profiler starts or stops, and c10 a warning about blocks allocated before it (which the meter's
    lowest point accounts for): a plan's pricing printed a pair per recording, noise to a user who never
    started a profiler. While the block runs, descriptor 2 goes to a temporary file; every other line
    written there is written back to stderr after it, in order. Where descriptor 2 cannot be redirected,
    nothing is done."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not _PROFILER_NOTE.match(line)]
            if kept:
                os.write(2, b"".join(kept))


class AllocatorRecorder:
    """``torch.profiler`` memory events of the CPU allocator while the context is active.

    After exit, :meth:`peak_bytes` is the largest rise of the running total of allocations minus frees:
    its highest value above the lowest value reached before it (0 at entry). The cyclic garbage
    collector is held off during the recording, so it frees no earlier work's garbage inside. A step
    that first frees memory allocated before it (``zero_grad(set_to_none=True)`` dropping last step's
    gradients) and then allocates is charged for what it allocates, as the storage tracker charges it
    (``max_memory_allocated`` minus the level before the step would net the two, which is why the CUDA
    meter reads the allocator's trace). And :meth:`window_peaks` gives, for each
    ``torch.profiler.record_function`` range whose name starts with ``prefix``, ``(level at start, peak
    inside, level at end)`` of that running total. Memory of other devices is ignored (a CUDA step is
    metered by the caching allocator instead).
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._events: list[Any] = []

    def __enter__(self) -> "AllocatorRecorder":
        # Python's cyclic collector would free garbage of earlier work (a profiling pass's values,
        # hundreds of MiB) in the middle of the step: that drop, counted as the step's lowest point,
        # hid what the step held before it (ResNet-152 read 251 MiB for a 409 MiB step). Hold the
        # collector off while recording (a full collection first would cost 0.2 s each time).
        self._collector_was_enabled = gc.isenabled()
        gc.disable()
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(_profiler_notes_dropped())
        try:
            self._profile.__enter__()
        except BaseException:
            self._quiet.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            try:
                self._profile.__exit__(*exc)
            finally:
                self._quiet.close()
        finally:
            if self._collector_was_enabled:
                gc.enable()
        self._events = list(self._profile.profiler.kineto_results.events())

    def _memory_steps(self) -> tuple[list[int], list[int]]:
        """Times (ns) and running totals after each CPU memory event, in time order."""
        memory = sorted((e.start_ns(), e.nbytes()) for e in self._events
                        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
        times, totals, running = [], [], 0
        for time_ns, nbytes in memory:
            running += nbytes
            times.append(time_ns)
            totals.append(running)
        return times, totals

    def peak_bytes(self) -> int:
        _, totals = self._memory_steps()
        lowest, rise = 0, 0
        for total in totals:
            lowest = min(lowest, total)
            rise = max(rise, total - lowest)
        return rise

    def window_peaks(self, prefix: str) -> dict[str, tuple[int, int, int]]:
        """``(level at start, peak inside, level at end)`` of each range named ``prefix + label``."""
        import bisect
        times, totals = self._memory_steps()
        windows: dict[str, tuple[int, int, int]] = {}
        for e in self._events:
            name = e.name()
            if not name.startswith(prefix) or name == "[memory]":
                continue
            start, end = e.start_ns(), e.start_ns() + e.duration_ns()
            first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
            level_start = totals[first - 1] if first > 0 else 0
            level_end = totals[last - 1] if last > 0 else 0
            peak = max([level_start, *totals[first:last]])
            windows[name[len(prefix):]] = (level_start, peak, level_end)
        return windows

    def markers(self, prefix: str) -> list[tuple[str, int, int]]:
        """For each ``record_function`` range named ``prefix + label``, in time order: ``(label, level at
        its end, peak since the previous one)`` of the running total. An empty range marks a moment
        (the per-op timeline of ``timeline.py``)."""
        import bisect
        times, totals = self._memory_steps()
        markers = sorted((e.start_ns() + e.duration_ns(), e.name()[len(prefix):]) for e in self._events
                         if e.name().startswith(prefix) and e.name() != "[memory]")
        rows, previous = [], 0
        for end_ns, label in markers:
            last = bisect.bisect_right(times, end_ns)
            level = totals[last - 1] if last > 0 else 0
            level_before = totals[previous - 1] if previous > 0 else 0
            peak = max([level_before, level, *totals[previous:last]])
            rows.append((label, level, peak))
            previous = last
        return rows


def allocator_peak_memory(step: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator hands out while ``step()`` runs, above what was allocated before,
    from ``torch.profiler`` memory events (:class:`AllocatorRecorder`): every allocation, those made
    inside kernels included. Also the meter for ``torch.compile``d steps, which a dispatch mode would
    push back to eager."""
    with AllocatorRecorder() as recorder:
        step()
    return recorder.peak_bytes()


def saved_tensor_bytes(run: Callable[[], Any]) -> int:
    """Bytes autograd saves for backward while ``run()`` executes, deduplicated by storage.

    Measured with ``torch.autograd.graph.saved_tensors_hooks``; storages that existed before ``run``
    (parameters, buffers, inputs) are not counted, matching the budget semantics. The saved tensors are
    released when ``run``'s results are dropped. A storage saved by a backward that died before ``run``
    returned (``max``'s indices when its values go unused) holds nothing and is not counted.
    """
    saved: dict[int, tuple[int, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is not None and key in tracker._live:
            saved[key] = (tensor.untyped_storage().nbytes(), tracker.serial[key])
        return tensor

    with StorageTracker() as tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()  # (a saved storage freed since, its address reused by another, is not counted)
        held = sum(nbytes for key, (nbytes, serial) in saved.items() if tracker.serial.get(key) == serial)
        del result
    return held


@dataclass(frozen=True)
class StepTiming:
    """Wall-clock seconds of repeated runs of a step (after warm-up); ``median_seconds`` is the summary."""

    seconds: tuple[float, ...]

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    def __repr__(self) -> str:
        return f"StepTiming(median {self.median_seconds * 1e3:.3f} ms over {len(self.seconds)} runs)"


def time_step(step: Callable[[], Any], *, repeats: int = 5, warmup: int = 1,
              device: str | torch.device | None = None) -> StepTiming:
    """Run ``step`` ``warmup`` times, then time ``repeats`` runs (synchronising CUDA around each)."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    for _ in range(warmup):
        step()
    return StepTiming(tuple(_timed_seconds(step, device) for _ in range(repeats)))


def time_steps_in_turn(steps: Sequence[Callable[[], Any]], *, rounds: int = 5, warmup: int = 1,
                       device: str | torch.device | None = None) -> list[StepTiming]:
    """Time several steps in turn, ``rounds`` times (after ``warmup`` rounds), so that a slow spell of the
    machine hits all of them alike; one :class:`StepTiming` per step. Compare ``min(timing.seconds)``
    (the least disturbed run) or the medians."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    seconds: list[list[float]] = [[] for _ in steps]
    for round_index in range(warmup + rounds):
        for k, step in enumerate(steps):
            elapsed = _timed_seconds(step, device)
            if round_index >= warmup:
                seconds[k].append(elapsed)
    return [StepTiming(tuple(times)) for times in seconds]


def _timed_seconds(step: Callable[[], Any], device: str | torch.device | None) -> float:
    """Wall-clock seconds of one ``step()``, with CUDA synchronised before and after on a CUDA device."""
    if _is_cuda(device):
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if _is_cuda(device):
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _floating_tensors(output: Any) -> list[torch.Tensor]:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model output contains no floating-point tensor to build a loss from")
    return tensors


def sum_loss(output: Any) -> torch.Tensor:
    """Sum of every floating-point tensor in ``output``. Its gradient is a broadcast scalar that owns
    no memory, which flatters memory measurements: prefer :func:`default_loss` to measure."""
    return sum((t.sum() for t in _floating_tensors(output)), torch.zeros(()))


def default_loss(output: Any) -> torch.Tensor:
    """``sum((t * t.detach()).sum())`` over every floating-point tensor ``t`` in ``output`` (tensor,
    tuple, list or dict): a squared norm whose gradient is the output itself.

    Like real losses (cross-entropy, MSE) it keeps the output until its backward and sends back a
    gradient as large as the output, with no other temporaries, so measured peaks are what training
    with a lean real loss sees.
    """
    return sum(((t * t.detach()).sum() for t in _floating_tensors(output)), torch.zeros(()))


def make_training_step(model: nn.Module, inputs: Sequence[Any],
                       loss_fn: Callable[[Any], torch.Tensor] = default_loss) -> Callable[[], float]:
    """A closure running one training step: clear gradients (to None), forward, loss, backward.

    Returns the loss value. Gradients are set to None first so that every step allocates them anew and
    the meters see the same thing each time (``model_state.training_step`` with this module's loss).
    """
    from .model_state import training_step
    return training_step(model, tuple(inputs), {}, loss_fn)


def profiler_peak_memory(step: Callable[[], Any]) -> int:
    """The CPU allocator's peak during ``step()`` (:func:`allocator_peak_memory`); kept under its old name."""
    return allocator_peak_memory(step)
