"""The lower-set DP's search (Kusumoto et al. 2019; the strategy space and the cost models are in
:mod:`.lower_set_dp`): every step between two lower sets of a family, priced once per model in a
:class:`TransitionTable`, and the DP over it for one budget (:func:`run_dp`), its feasibility test and
the least budget it finds feasible.

A model gives per step ``a -> b`` (family indices, ``b`` a strict superset of ``a``) its overhead (cost
units), its model peak (bytes) and the checkpoint bytes it keeps; a strategy fits budget ``B`` when, at
every step, the checkpoint bytes kept before it plus its peak are at most ``B``. Pure Python and numpy
over the cost graph."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import SolverError
from .lower_sets import _bits

if TYPE_CHECKING:
    from .lower_set_dp import ExecutionModel, PaperModel

    Model = PaperModel | ExecutionModel

__all__ = ["DPResult", "TransitionTable", "table_of", "run_dp", "feasible", "minimal_model_budget"]


@dataclass(frozen=True)
class DPResult:
    """A DP answer in its own model: the lower sets, total overhead and model peak."""

    lower_sets: tuple[frozenset[int], ...]
    overhead: float
    peak: float


class TransitionTable:
    """Every step ``a -> b`` between lower sets (``b`` a strict superset of ``a`` in the family) of one
    model, as flat arrays of edges, built once per model (``table_of``) and read by every DP run.

    Edges are grouped by source ``a`` (``start[a]:start[a + 1]``) and sorted by peak within a group;
    ``into[into_start[b]:into_start[b + 1]]`` are the edges into ``b``, by ascending source.
    Per edge: ``peaks``, ``targets``, ``kept`` (bytes the step keeps), ``overheads`` and ``next_least``
    (the target's cheapest next step: its smallest peak; 0 for ``V``)."""

    def __init__(self, model: Model) -> None:
        f = model.family
        count = len(f.sets)
        groups = [_steps_from(model, a) for a in range(count)]
        self.start = np.concatenate(([0], np.cumsum([len(g[0]) for g in groups]))).astype(np.int64)
        self.targets, self.peaks, self.overheads, self.kept = (
            np.concatenate([g[c] for g in groups]) if groups else np.zeros(0) for c in range(4))
        self.targets = self.targets.astype(np.int64)
        self.sources = np.repeat(np.arange(count), np.diff(self.start))
        has_steps = np.diff(self.start) > 0
        least = np.zeros(count)
        least[has_steps] = self.peaks[self.start[:-1][has_steps]]
        self.next_least = least[self.targets]
        self.into = np.lexsort((self.sources, self.targets))
        self.into_start = np.searchsorted(self.targets[self.into], np.arange(count + 1))

    def from_(self, a: int) -> slice:
        """The edges out of lower set ``a``."""
        return slice(int(self.start[a]), int(self.start[a + 1]))


def _steps_from(model: Model, a: int) -> tuple[np.ndarray, ...]:
    """(targets, peaks, overheads, kept) of the steps out of ``a``, sorted by peak (stable: by target
    among equal peaks)."""
    if hasattr(model, "transition_arrays_from"):  # the execution model: vectorized
        targets, peaks, overheads, kept = model.transition_arrays_from(a)
    else:
        f = model.family
        lower = f.sets[a]
        row = [(b, *model.transition(a, b)) for b in range(a + 1, len(f.sets))
               if f.size[b] > f.size[a] and not lower & ~f.sets[b]]
        targets = np.array([r[0] for r in row], dtype=np.int64)
        overheads, peaks, kept = (np.array([r[c] for r in row], dtype=np.float64) for c in (1, 2, 3))
    order = np.argsort(peaks, kind="stable")
    return targets[order], peaks[order], overheads[order], kept[order]


def table_of(model: Model) -> TransitionTable:
    """The model's :class:`TransitionTable`, built on first use and kept on the model."""
    cached = getattr(model, "_transition_table", None)
    if cached is None:
        cached = model._transition_table = TransitionTable(model)
    return cached


class _States:
    """Every finalized Pareto state, in growable arrays: overhead, checkpoint bytes, peak so far, the
    index of the state it came from (-1 for the start) and the family index of its lower set."""

    def __init__(self) -> None:
        self.size = 0
        self.columns = [np.empty(1024), np.empty(1024), np.empty(1024), np.empty(1024, dtype=np.int64),
                        np.empty(1024, dtype=np.int64)]

    def add(self, values: list[np.ndarray]) -> int:
        count = len(values[0])
        while self.size + count > len(self.columns[0]):
            self.columns = [np.concatenate((c, np.empty_like(c))) for c in self.columns]
        for column, value in zip(self.columns, values):
            column[self.size:self.size + count] = value
        start, self.size = self.size, self.size + count
        return start


def run_dp(model: Model, budget: float, variant: str = "time") -> DPResult | None:
    """The DP over ``model.family``; None when no strategy fits ``budget`` in the model.

    Each lower set's Pareto front is sorted by checkpoint bytes (ascending; overhead then strictly
    descending). A transition with model peak ``p`` applies to the prefix of states with
    ``checkpoints + p <= budget`` (binary search); all the prefixes reaching one lower set are gathered
    and pruned in a few vectorized steps. A model whose overheads telescope (``overhead_telescopes``)
    has one state per set but ``V``, and runs :func:`_run_least_checkpoints`, with the same answers.
    """
    if variant not in ("time", "memory"):
        raise ValueError(f"variant must be 'time' or 'memory', got {variant!r}")
    f = model.family
    if f.sets[0] != 0 or f.sets[-1] != (1 << f.n) - 1:
        raise SolverError("the lower-set family must contain ∅ and V")
    if getattr(model, "overhead_telescopes", False):
        return _run_least_checkpoints(model, budget, variant)
    return _run_fronts(model, budget, variant)


def _run_fronts(model: Model, budget: float, variant: str) -> DPResult | None:
    """:func:`run_dp` with a Pareto front per lower set (any model)."""
    f = model.family
    count = len(f.sets)
    table = table_of(model)
    states = _States()
    usable_states = np.zeros(len(table.targets), dtype=np.int64)  # per edge: how many of its source's states take it
    front_start = np.zeros(count, dtype=np.int64)
    front_size = np.zeros(count, dtype=np.int64)
    front_start[0] = states.add([np.zeros(1), np.zeros(1), np.zeros(1), np.full(1, -1), np.zeros(1)])
    front_size[0] = 1
    for a in range(count):
        if a > 0:
            _merge(table, usable_states, a, states, front_start, front_size)
        if front_size[a] == 0 or a == count - 1:
            continue
        first = front_start[a]
        kept_front = states.columns[1][first:first + front_size[a]]
        edges = table.from_(a)
        peaks = table.peaks[edges]
        usable = int(np.searchsorted(peaks, budget - kept_front[0], side="right"))
        if not usable:
            continue
        peaks, kept = peaks[:usable], table.kept[edges][:usable]
        # a state arriving at b with more checkpoint memory than b's cheapest next step allows is dead
        room = budget - kept - table.next_least[edges][:usable]
        usable_states[edges.start:edges.start + usable] = np.minimum(
            np.searchsorted(kept_front, budget - peaks, side="right"),
            np.searchsorted(kept_front, room, side="right"))
    last = count - 1
    if front_size[last] == 0:
        return None
    first = front_start[last]
    overheads = states.columns[0][first:first + front_size[last]]
    best = first + (int(np.argmin(overheads)) if variant == "time" else 0)  # sorted by checkpoint bytes
    chain = []
    state = best
    while states.columns[4][state] != 0:
        chain.append(frozenset(_bits(f.sets[int(states.columns[4][state])])))
        state = int(states.columns[3][state])
    return DPResult(tuple(reversed(chain)), float(states.columns[0][best]), float(states.columns[2][best]))


def _run_least_checkpoints(model: Model, budget: float, variant: str) -> DPResult | None:
    """:func:`run_dp` for a model whose overheads telescope: every step's overhead is
    ``T(b) - T(a)`` in exact integer arithmetic (quantized times), but the step into ``V``, which costs 0.
    Every strategy reaching a set ``b != V`` has then spent ``T(b)``, so ``b``'s Pareto front is one
    state: the least checkpoint bytes, then the least peak, then the first source in the fronts DP's
    gathering order (the lowest ``a``). Here each set's state is final when it is reached in family
    order, and its steps update their targets' states: one vectorized pass per set instead of a merge
    per set. Into ``V`` the candidates are compared as the fronts DP chooses among them: time-centric by
    (overhead, checkpoint bytes, peak), memory-centric by (checkpoint bytes, overhead, peak), ties to
    the lowest source. The tests compare both runs answer for answer."""
    table = table_of(model)
    f = model.family
    last = len(f.sets) - 1
    kept = np.full(last + 1, np.inf)  # per set: checkpoint bytes, peak, overhead of its state and where it came from
    peak = np.full(last + 1, np.inf)
    overhead = np.zeros(last + 1)
    parent = np.full(last + 1, -1, dtype=np.int64)
    kept[0], peak[0] = 0.0, 0.0
    room = budget - table.kept - table.next_least  # as the fronts DP computes it: dead ends are never stored
    best = None  # into V: (key, overhead, checkpoint bytes, peak, source)
    for a in range(last):
        k = kept[a]
        if k == np.inf:
            continue
        first = int(table.start[a])
        usable = first + int(np.searchsorted(table.peaks[first:table.start[a + 1]], budget - k, side="right"))
        if usable == first:
            continue
        steps = first + np.flatnonzero((k <= budget - table.peaks[first:usable]) & (k <= room[first:usable]))
        if not len(steps):
            continue
        targets = table.targets[steps]
        new_kept = k + table.kept[steps]
        new_peak = np.maximum(peak[a], k + table.peaks[steps])
        new_overhead = overhead[a] + table.overheads[steps]
        into_v = np.flatnonzero(targets == last)
        if len(into_v):
            into = int(into_v[0])
            values = (float(new_overhead[into]), float(new_kept[into]), float(new_peak[into]))
            key = values if variant == "time" else (values[1], values[0], values[2])
            if best is None or key < best[0]:
                best = (key, *values, a)
        old_kept, old_peak = kept[targets], peak[targets]
        better = ((new_kept < old_kept) | ((new_kept == old_kept) & (new_peak < old_peak))) & (targets != last)
        chosen = targets[better]
        kept[chosen], peak[chosen] = new_kept[better], new_peak[better]
        overhead[chosen], parent[chosen] = new_overhead[better], a
    if best is None:
        return None
    chain = [frozenset(_bits(f.sets[last]))]
    state = best[4]
    while state != 0:
        chain.append(frozenset(_bits(f.sets[state])))
        state = int(parent[state])
    return DPResult(tuple(reversed(chain)), best[1], best[3])


def _merge(table: TransitionTable, usable_states: np.ndarray, target: int, states: _States,
           front_start: np.ndarray, front_size: np.ndarray) -> None:
    """Gather the states reaching ``target`` (through each edge into it, the first ``usable_states``
    states of the edge's source) and store the ones not dominated in (overhead, checkpoint bytes) as
    ``target``'s front, sorted by checkpoint bytes; equal points keep the lower peak."""
    edges = table.into[table.into_start[target]:table.into_start[target + 1]]
    lengths = usable_states[edges]
    edges, lengths = edges[lengths > 0], lengths[lengths > 0]
    if not len(edges):
        return
    total = int(lengths.sum())
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    index = np.repeat(front_start[table.sources[edges]] - offsets, lengths) + np.arange(total)
    overhead, kept, peak = (np.repeat(column[edges], lengths) for column in (table.overheads, table.kept, table.peaks))
    source_kept = states.columns[1][index]
    overheads = states.columns[0][index] + overhead
    kept_bytes = source_kept + kept
    if total > _PREFILTER_ABOVE:
        survivors = _not_dominated_across_buckets(overheads, kept_bytes)
        index, overheads, kept_bytes, source_kept, peak = (
            a[survivors] for a in (index, overheads, kept_bytes, source_kept, peak))
    peaks = np.maximum(states.columns[2][index], source_kept + peak)
    order = np.lexsort((peaks, overheads, kept_bytes))  # by kept bytes, then overhead, then peak
    ordered = overheads[order]
    # keep a state when its overhead is below every overhead with less (or equal) checkpoint memory
    running = np.minimum.accumulate(np.concatenate(([np.inf], ordered[:-1])))
    keep = order[ordered < running]
    front_start[target] = states.add([overheads[keep], kept_bytes[keep], peaks[keep], index[keep],
                                      np.full(len(keep), target)])
    front_size[target] = len(keep)


#: Candidate states of one merge above which dominated ones are first dropped by buckets of checkpoint bytes.
_PREFILTER_ABOVE = 2048
_BUCKETS = 512


def _not_dominated_across_buckets(overheads: np.ndarray, kept_bytes: np.ndarray) -> np.ndarray:
    """Which candidates survive a cheap first pass of the front's rule: split the range of checkpoint bytes
    into ``_BUCKETS`` equal buckets and drop a candidate whose overhead is at least the least overhead of
    a lower bucket (a state with strictly less checkpoint memory and no more overhead dominates it).
    Exact: the sort that follows would drop it too, and the states it leaves keep their running minimum
    (the dominating state comes first). ``O(n)`` instead of the sort's ``O(n log n)``; in the exact DP on
    ResNet-152 about 1 % of the candidates survive a merge."""
    low, high = float(kept_bytes.min()), float(kept_bytes.max())
    if high <= low:
        return np.ones(len(kept_bytes), dtype=bool)
    bucket = np.minimum(((kept_bytes - low) * (_BUCKETS / (high - low))).astype(np.int64), _BUCKETS - 1)
    least = np.full(_BUCKETS + 1, np.inf)
    np.minimum.at(least, bucket + 1, overheads)
    before = np.minimum.accumulate(least)  # before[j]: the least overhead in buckets below j
    return overheads < before[bucket]


def feasible(model: Model, budget: float) -> bool:
    """Whether any strategy fits ``budget`` in the model. Only the least checkpoint memory per lower set
    matters for that (the budget test reads nothing else), so this is one pass over the transitions."""
    table = table_of(model)
    count = len(model.family.sets)
    least = np.full(count, np.inf)
    least[0] = 0.0
    for a in range(count - 1):
        if least[a] == np.inf:
            continue
        edges = table.from_(a)
        k = int(np.searchsorted(table.peaks[edges], budget - least[a], side="right"))
        if k:
            np.minimum.at(least, table.targets[edges][:k], least[a] + table.kept[edges][:k])
    return bool(least[-1] < np.inf)


def minimal_model_budget(model: Model, variant: str = "time") -> float:
    """Smallest budget the DP finds feasible in its own model (bisection: feasibility is monotone). The
    same for both variants, which differ only in which feasible strategy they return."""
    table = table_of(model)
    firsts = table.start[:-1][np.diff(table.start) > 0]  # each source's cheapest step
    high_budget = max(float(table.peaks.max(initial=-math.inf)) + sum(table.kept[firsts].tolist()), 1.0)
    while not feasible(model, high_budget):
        high_budget *= 2
    low_budget = 0.0
    while high_budget - low_budget > max(1.0, high_budget * 1e-6):
        middle = (low_budget + high_budget) / 2
        if feasible(model, middle):
            high_budget = middle
        else:
            low_budget = middle
    return high_budget
