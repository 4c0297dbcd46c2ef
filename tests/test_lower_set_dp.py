"""The lower-set DP (Kusumoto et al. 2019): exact against exhaustive search, and on the paper's graphs."""
import pytest
from hypothesis import assume, given, settings, strategies as st

from recompute_graph import SolverError
from recompute_graph.benchmark_graphs import benchmark_dir, load_graph
from recompute_graph.solvers import SOLVERS
from recompute_graph.solvers.lower_set_dp import (ExecutionModel, PaperModel, enumerate_lower_sets,
                                                  minimal_model_budget, principal_lower_sets, run_dp,
                                                  strategy_cost)

from strategies import cost_graphs


def all_strategies(family):
    """Every increasing sequence of lower sets of the family from ∅ to V (exhaustive)."""
    full = family.sets[-1]

    def extend(a):
        if family.sets[a] == full:
            yield []
            return
        for b in range(len(family.sets)):
            if family.size[b] > family.size[a] and not family.sets[a] & ~family.sets[b]:
                for rest in extend(b):
                    yield [b] + rest
    for chain in extend(0):
        yield [frozenset(v for v in range(family.n) if family.sets[b] >> v & 1) for b in chain]


def brute_force(model, budget):
    best = None
    for strategy in all_strategies(model.family):
        overhead, peak = strategy_cost(model, strategy)
        if peak <= budget and (best is None or overhead < best):
            best = overhead
    return best


@settings(max_examples=300, deadline=None)
@given(cost_graphs(max_nodes=10), st.sampled_from([PaperModel, ExecutionModel]), st.floats(0.0, 1.0))
def test_dp_exact_equals_exhaustive_search(graph, model_class, fraction):
    family = enumerate_lower_sets(graph)
    assume(len(family.sets) <= 24)
    model = model_class(family)
    low = minimal_model_budget(model)
    high = run_dp(model, float("inf")).peak
    budget = low + fraction * (high - low)
    result = run_dp(model, budget)
    expected = brute_force(model, budget)
    assert result is not None and expected is not None
    assert result.overhead == pytest.approx(expected)
    overhead, peak = strategy_cost(model, result.lower_sets)
    assert overhead == pytest.approx(result.overhead) and peak == pytest.approx(result.peak) and peak <= budget
    assert run_dp(model, low * (1 - 1e-3) - 1) is None


@settings(max_examples=100, deadline=None)
@given(cost_graphs(max_nodes=12), st.floats(0.0, 1.0))
def test_approximate_dp_is_feasible_and_never_better_than_the_exact_one(graph, fraction):
    exact, approx = PaperModel(enumerate_lower_sets(graph)), PaperModel(principal_lower_sets(graph))
    low_exact, low_approx = minimal_model_budget(exact), minimal_model_budget(approx)
    assert low_exact <= low_approx * (1 + 1e-6) + 1
    budget = low_approx + fraction * low_approx
    approx_result, exact_result = run_dp(approx, budget), run_dp(exact, budget)
    assert approx_result is not None and exact_result is not None
    assert exact_result.overhead <= approx_result.overhead + 1e-9


@settings(max_examples=60, deadline=None)
@given(cost_graphs(max_nodes=10))
def test_overhead_does_not_increase_with_the_budget(graph):
    for model in (PaperModel(enumerate_lower_sets(graph)), ExecutionModel(principal_lower_sets(graph))):
        low = minimal_model_budget(model)
        overheads = [run_dp(model, low * factor).overhead for factor in (1.0, 1.2, 1.5, 2.0, 4.0)]
        assert overheads == sorted(overheads, reverse=True)


def test_memory_centric_keeps_less_checkpoint_memory_for_more_compute():
    graph = load_graph(benchmark_dir() / "kusumoto2019" / "cg_resnet50.txt")
    model = PaperModel(enumerate_lower_sets(graph))
    budget = 1.5 * minimal_model_budget(model)
    time_centric, memory_centric = run_dp(model, budget, "time"), run_dp(model, budget, "memory")
    assert memory_centric.overhead > time_centric.overhead
    with pytest.raises(ValueError, match="variant"):
        run_dp(model, budget, "space")


# lower-set counts of algorithms.md §1.4, and where the exact DP beats the approximate one
PAPER_GRAPHS = {"vgg19": (47, False), "unet": (331, True), "resnet50": (241, True), "resnet152": (581, False),
                "densenet": (569, False)}


@pytest.mark.parametrize("name", sorted(PAPER_GRAPHS))
def test_paper_graphs_lower_set_counts_and_exact_vs_approximate_minimal_budgets(name):
    graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
    count, exact_is_better = PAPER_GRAPHS[name]
    family = enumerate_lower_sets(graph)
    assert len(family.sets) == count
    exact = minimal_model_budget(PaperModel(family))
    approx = minimal_model_budget(PaperModel(principal_lower_sets(graph)))
    assert (exact < approx * (1 - 1e-4)) == exact_is_better
    assert exact <= approx * (1 + 1e-6)


@pytest.mark.parametrize("name, count", [("googlenet", "27,358"), ("pspnet", "12,533")])
def test_too_many_lower_sets_is_a_solver_error_saying_how_many(name, count):
    graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
    with pytest.raises(SolverError, match=f"{count} lower sets.*dp_approx"):
        SOLVERS["dp_exact"](graph, None)


def test_dp_refuses_joint_graphs():
    graph = load_graph(benchmark_dir() / "checkmate2020" / "VGG16_256_224x224_train.json")
    with pytest.raises(SolverError, match="explicit backward"):
        SOLVERS["dp_approx"](graph, None)


def test_a_large_gradient_at_the_head_does_not_weigh_on_every_segment():
    """The execution model's two gradients in flight are the largest of each segment, not of the graph:
    with the graph's largest (a language model's logits) charged to every segment, the DPs' lowest peak
    on this chain was 8800 B where Chen's prefix plan, in their family, reaches 8100 B."""
    from recompute_graph import CostGraph, CostNode
    from recompute_graph.planner import run_solver
    n = 24
    nodes = tuple(CostNode(i, f"n{i}", predecessors=(i - 1,) if i else (), output_bytes=4000 if i == n - 1 else 100,
                           grad_bytes=4000 if i == n - 1 else 100, backward_needs=(i - 1,) if i else (),
                           forward_cost=1.0, backward_cost=1.0) for i in range(n))
    graph = CostGraph("head", nodes, output_indices=(n - 1,))
    chen = run_solver("chen_greedy", graph, None).peak_bytes
    for name in ("dp_exact", "dp_approx"):
        assert run_solver(name, graph, None).peak_bytes <= chen


@settings(max_examples=40, deadline=None)
@given(cost_graphs(max_nodes=9), st.sampled_from(["segment", "graph"]), st.booleans())
def test_the_execution_models_vectorized_transitions_are_its_pairwise_ones(graph, in_flight, exact):
    """``ExecutionModel.transitions_from(a)`` (numpy over the family, what the DP's table is built
    from) gives :meth:`transition`'s values for every strict superset, and no other target."""
    family = enumerate_lower_sets(graph) if exact else principal_lower_sets(graph)
    model = ExecutionModel(family, in_flight)
    for a, lower in enumerate(family.sets):
        expected = []
        for b in range(a + 1, len(family.sets)):
            if family.size[b] > family.size[a] and not lower & ~family.sets[b]:
                overhead, peak, kept = model.transition(a, b)
                expected.append((peak, b, overhead, kept))
                segment = [v for v in range(family.n) if family.sets[b] >> v & 1 and not lower >> v & 1]
                grads = [g if in_flight == "graph" or v in segment else 0 for v, g in enumerate(model.grad)]
                assert model.in_flight(a, b) == 2 * max(grads, default=0)
        assert model.transitions_from(a) == expected


def test_boundaries_and_gradients_in_flight_over_more_nodes_than_one_word_holds():
    """A 150-node graph of branching blocks (three 64-bit words per set): each set's boundary is the
    bitwise one (``LowerSetFamily._boundary``), and the largest gradient of every step ``a -> b`` the
    plain maximum over ``b \\ a``, whichever word it lies in."""
    import random
    from recompute_graph.graph import CostGraph, CostNode
    rng = random.Random(7)
    nodes = []
    for v in range(150):
        reads = () if v == 0 else (v - 1,) if v % 5 else (v - 1, max(0, v - 7))
        nodes.append(CostNode(v, f"n{v}", predecessors=tuple(sorted(set(reads))), output_bytes=100,
                              grad_bytes=rng.randrange(1, 10_000), backward_needs=reads, forward_cost=1.0,
                              backward_cost=1.0))
    family = principal_lower_sets(CostGraph("words", tuple(nodes)))
    assert family.n > 128
    assert family.boundary == [family._boundary(lower) for lower in family.sets]
    model = ExecutionModel(family, "segment")
    for a in range(0, len(family.sets), 7):
        for b in family.supersets_after(a)[::5]:
            later, lower = family.sets[b], family.sets[a]
            segment = [model.grad[v] for v in range(family.n) if later >> v & 1 and not lower >> v & 1]
            assert model.in_flight(a, int(b)) == 2 * max(segment)


@settings(max_examples=40, deadline=None)
@given(cost_graphs(max_nodes=10), st.lists(st.floats(0.9, 3.0), min_size=2, max_size=8), st.booleans(),
       st.sampled_from(["time", "memory"]))
def test_answers_kept_across_budgets_are_the_dps_optimum_at_every_budget(graph, factors, exact, variant):
    """``_Answers`` reuses the DP's answer at ``B`` for budgets in ``[its peak, B]`` and skips the DP below
    a budget where it found nothing: at every budget, in any order, the answer it gives has the fresh
    DP's objective and fits the budget in the model."""
    from recompute_graph.solvers.lower_set_dp import _Answers, model_for

    family = enumerate_lower_sets(graph) if exact else principal_lower_sets(graph)
    model = model_for(graph)(family)
    answers = _Answers(model, "dp_exact", variant)
    minimal = minimal_model_budget(model)
    for factor in factors:
        budget = minimal * factor
        fresh = run_dp(model, budget, variant)
        kept = answers.plan(graph, budget)
        if fresh is None:
            assert kept is None
            continue
        lower_sets = next(entry[2] for entry in answers.known if entry[3] is kept)
        overhead, peak = strategy_cost(model, lower_sets)
        assert peak <= budget
        if variant == "time":
            assert overhead == pytest.approx(fresh.overhead)
        else:  # least checkpoint memory: the same final front, so the same checkpoint bytes
            assert strategy_checkpoints(model, lower_sets) == strategy_checkpoints(model, fresh.lower_sets)


def strategy_checkpoints(model, lower_sets):
    """Checkpoint bytes a strategy keeps in ``model`` (the memory-centric DP's objective)."""
    index = {s: i for i, s in enumerate(model.family.sets)}
    a, total = 0, 0.0
    for lower in lower_sets:
        b = index[sum(1 << v for v in lower)]
        total += model.transition(a, b)[2]
        a = b
    return total


@pytest.mark.parametrize("name", ["unet", "resnet50"])
def test_the_merges_first_pass_by_buckets_changes_no_answer(name, monkeypatch):
    """The merge drops states dominated across buckets of checkpoint bytes before sorting (above
    ``_PREFILTER_ABOVE`` candidates): the DP's answers with and without that pass are identical."""
    import recompute_graph.solvers.lower_set_search as lower_set_dp

    graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
    model = PaperModel(enumerate_lower_sets(graph))
    minimal = minimal_model_budget(model)
    answers = {}
    for threshold in (0, 10 ** 12):
        monkeypatch.setattr(lower_set_dp, "_PREFILTER_ABOVE", threshold)
        answers[threshold] = [run_dp(model, minimal * factor, variant) for factor in (1.0, 1.3, 2.0)
                              for variant in ("time", "memory")]
    assert answers[0] == answers[10 ** 12]
    assert all(answer is not None for answer in answers[0])


@settings(max_examples=150, deadline=None)
@given(cost_graphs(max_nodes=12), st.booleans(), st.sampled_from(["segment", "graph"]),
       st.lists(st.floats(0.95, 3.0), min_size=1, max_size=4), st.sampled_from(["time", "memory"]))
def test_the_execution_models_shortest_path_gives_the_fronts_dps_answers(graph, exact, in_flight, factors,
                                                                         variant):
    """Under the execution model every strategy reaching a set has spent its quantized time, so the DP
    runs as a shortest path over least checkpoint bytes (``_run_least_checkpoints``): the same lower
    sets, overhead and peak as the DP with a Pareto front per set, at budgets from just below the least
    feasible one up, ties included (the graphs' bytes repeat)."""
    from recompute_graph.solvers import lower_set_search

    family = enumerate_lower_sets(graph) if exact else principal_lower_sets(graph)
    model = ExecutionModel(family, in_flight)
    assert model.overhead_telescopes
    minimal = minimal_model_budget(model)
    for factor in factors:
        fronts = lower_set_search._run_fronts(model, minimal * factor, variant)
        assert lower_set_search._run_least_checkpoints(model, minimal * factor, variant) == fronts
        assert run_dp(model, minimal * factor, variant) == fronts


@pytest.mark.parametrize("name", ["unet", "resnet50"])
def test_the_shortest_path_and_the_fronts_dp_agree_on_the_paper_graphs_in_the_execution_model(name):
    """The same comparison on two of Kusumoto's graphs (all their lower sets, both in-flight bounds),
    over budgets from the least feasible one to four times it."""
    from recompute_graph.solvers import lower_set_search

    graph = load_graph(benchmark_dir() / "kusumoto2019" / f"cg_{name}.txt")
    family = enumerate_lower_sets(graph)
    for in_flight in ("segment", "graph"):
        model = ExecutionModel(family, in_flight)
        minimal = minimal_model_budget(model)
        answers = 0
        for factor in (0.99, 1.0, 1.05, 1.2, 1.5, 2.0, 3.0, 4.0):
            for variant in ("time", "memory"):
                fronts = lower_set_search._run_fronts(model, minimal * factor, variant)
                assert lower_set_search._run_least_checkpoints(model, minimal * factor, variant) == fronts
                answers += fronts is not None
        assert answers == 14  # all but the budget below the least feasible one


def test_twin_branches_tie_into_V_and_both_runs_take_the_first():
    """Two identical branches: at the least feasible budget the strategies through either branch tie in
    overhead, checkpoint bytes and peak on the step into ``V``, and both DP runs take the first branch's
    (the fronts DP's gathering order)."""
    from recompute_graph import CostNode
    from recompute_graph.graph import CostGraph
    from recompute_graph.solvers import lower_set_search

    def node(i, reads):
        return CostNode(i, f"n{i}", predecessors=reads, output_bytes=100, grad_bytes=100,
                        backward_needs=reads or (i,), forward_cost=1.0, backward_cost=1.0)
    graph = CostGraph("twins", (node(0, ()), node(1, (0,)), node(2, (1,)), node(3, (0,)), node(4, (3,)),
                                node(5, (2, 4))))
    for family in (principal_lower_sets(graph), enumerate_lower_sets(graph)):
        for variant in ("time", "memory"):
            model = ExecutionModel(family)
            budget = minimal_model_budget(model)
            fronts = lower_set_search._run_fronts(model, budget, variant)
            assert fronts.lower_sets == (frozenset({0}), frozenset({0, 1, 2}), frozenset(range(6)))
            assert lower_set_search._run_least_checkpoints(model, budget, variant) == fronts
