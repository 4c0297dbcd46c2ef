"""The module ``optimize(model, budget)`` returns on the compiler path (its default wherever capture
works): the compiler path behind one call.

:class:`CompiledRecomputedModule` shares the original's submodules, parameters and buffers (same
objects, same ``state_dict`` keys), like the executor's ``RecomputedModule``. In training mode with grad
enabled it runs ``torch.compile(call, backend=budget_backend(budget, ...), fullgraph=True,
dynamic=False)``, where ``call`` calls the model from a code object of the signature's own (so that
Dynamo's cache and recompilation limit are not shared with other models of the class): Dynamo
captures the call, AOTAutograd traces the functional joint forward+backward graph, our partitioner
prices it, plans it at the budget with the planner's solvers and lowers the plan into a forward graph
that returns the kept values and a backward graph with the recompute nodes written out where they run
(``joint_lowering``). In ``eval()`` or under ``torch.no_grad()`` it runs the original's plain forward.

Planning happens on the first training call of each input signature (shapes, dtypes, call structure,
autocast setting; ``dynamic=False``, so a new shape is compiled and planned again), or at once on
example inputs (:meth:`CompiledRecomputedModule.plan`). Either way the first call of a signature is
first run as a trial forward whose effects are undone (BatchNorm buffers put back, random generators
restored, the output dropped): a budget that cannot be met raises ``InfeasibleBudgetError`` and a model
that cannot be captured whole raises ``CaptureError`` naming why, with the model as it was; with a
``fallback`` (``optimize(..., compiler="auto")``, the default) the module warns
(``CompilerFallbackWarning``) and hands every later call to the module ``fallback()`` builds, the
schedule executor's.

Invariants: gradients, BatchNorm statistics and dropout masks are those of eager autograd (the
lowering replays recomputed dropouts from RNG snapshots and recomputes BatchNorm without touching its
running statistics); a step's predicted peak is ``recompute_plan.predicted_step_peak_bytes``, bytes.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from .collector import full_collections_deferred
from .errors import (ChangingStateError, CompilerFallbackWarning, InfeasibleBudgetError, RecompilationWarning,
                     RecomputeError, user_stacklevel)
from .joint_capture import CaptureError
from .compile_backend import budget_backend
from .joint_lowering import InfeasibleBudgetWarning, Lowered
from .model_state import (PlainValues, changed_again, changing_state_message, generator_states, preserved_state,
                          replaced_submodules_refused)
from .joint_allocations import own_output_known
from .output_structure import OutputStructure
from .outside_containers import OutsideContainers
from .losses import own_loss
from .module_hooks import planned_hooks_key
from .optimized_module import (OUTER_COMPILE_REASON, PeakWatch, SharedModelModule, _cuda_device, _signature_key,
                               infeasible_for_new_call)

__all__ = ["CompiledRecomputedModule", "ignored_logging_calls", "logging_calls_ignored"]


class CompiledRecomputedModule(SharedModelModule):
    """Wraps a model and trains it through ``torch.compile`` with our budgeted partitioner.

    ``saved_plan``: a ``RecomputePlan`` (``plan.save(path)`` of an earlier one, or ``plan_for(...,
    compiler=True)`` made on meta tensors) reused instead of solving when the joint cost graph has its
    structure (``saved_plans.reuse_plan``); ``device_profile``: what times FLOPs in the cost graph;
    ``graph_compiler``: ``"inductor"`` to compile the generated graphs with inductor (``budget_backend``).

    ``recompute_plan``: the :class:`~recompute_graph.planner.RecomputePlan` of the signature last
    planned or run (None before the first); ``lowerings``: every
    :class:`~recompute_graph.joint_lowering.Lowered` made for this module, oldest first;
    ``backward_code``: the generated backward of that signature's plan, each recompute node a forward
    op on the line before its use.
    """

    def __init__(self, model: nn.Module, budget: Any, *, solver: str = "auto",
                 loss_fn: "Callable[[Any], torch.Tensor] | None" = None, on_infeasible: str = "raise",
                 fallback: "Callable[[], nn.Module] | None" = None, saved_plan: Any = None,
                 device_profile: Any = "cpu", graph_compiler: str | None = None) -> None:
        super().__init__(model)
        lowerings: list[Lowered] = []
        backend = budget_backend(budget, solver=solver, loss_fn=loss_fn, on_infeasible=on_infeasible,
                                 on_lowered=lowerings.append, saved_plan=saved_plan, device_profile=device_profile,
                                 **({"graph_compiler": graph_compiler} if graph_compiler is not None else {}))
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_steps", {})  # signature key -> the compiled call for it
        object.__setattr__(self, "_lowerings", lowerings)
        object.__setattr__(self, "_planned", {})  # signature key -> the Lowered of its graph
        object.__setattr__(self, "_current", None)  # the signature of the last call planned or run
        object.__setattr__(self, "_watched", set())  # signatures whose first CUDA step was checked
        object.__setattr__(self, "_recompiled", set())  # signatures compiled again since planned (warned)
        object.__setattr__(self, "_own_outputs", {})  # signature key -> its own forward's OutputStructure
        object.__setattr__(self, "_fallback", fallback)
        object.__setattr__(self, "delegate", None)  # the fallback module, once the compiler path failed

    @property
    def lowerings(self) -> tuple[Lowered, ...]:
        return tuple(self._lowerings)

    @property
    def recompute_plan(self) -> Any:
        if self.delegate is not None:
            return self.delegate.recompute_plan
        lowered = self._planned.get(self._current)
        return lowered.plan if lowered is not None else None

    @property
    def backward_code(self) -> str:
        """The generated backward of ``recompute_plan``, as Python ("" before the first plan)."""
        lowered = self._planned.get(self._current)
        return lowered.backward_code if lowered is not None else ""

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        """Plan for training calls like this one now (compiling the model for them) and return the
        plan; the call's effects are undone (see the module docstring)."""
        self._check_call(args, kwargs)
        if self.delegate is not None:
            return self.delegate.plan(*args, **kwargs)
        key = (*_signature_key(args, kwargs), planned_hooks_key(self._named_modules, self._original_class))
        if key not in self._planned:  # a new call signature, or forward hooks added: captured and planned
            lowered, started = len(self._lowerings), time.perf_counter()
            try:
                self._trial(key, args, kwargs)
                if len(self._lowerings) == lowered:
                    raise CaptureError(f"{self._original_class}: torch.compile made no backward graph for this "
                                       "call (nothing in it requires grad), so there is nothing to plan")
            except InfeasibleBudgetError as error:
                if self._planned:
                    raise infeasible_for_new_call(error, args, kwargs) from None
                reason = self._failure_beyond_the_budget(key, args, kwargs, lowered)
                if reason is None:
                    raise
                self._fall_back(reason)
                return self.delegate.plan(*args, **kwargs)
            except RecomputeError as error:
                self._fall_back(error)
                return self.delegate.plan(*args, **kwargs)
            self._planned[key] = self._lowerings[-1]
            self._signature_planned(key, time.perf_counter() - started, args, kwargs)
        object.__setattr__(self, "_current", key)
        return self._planned[key].plan

    def _failure_beyond_the_budget(self, key: tuple, args: tuple, kwargs: dict, lowered: int
                                   ) -> RecomputeError | None:
        """Where the first signature's budget is infeasible on the compiler path and there is a fallback:
        whether the compiler path would fail anyway past planning (an unused dropout, found by the trial's
        random-draw check, which needs a compiled forward). The trial runs again planned at the floor, and
        what it made is dropped (the compiled call, its lowerings, its graphs), so the next call compiles
        and plans afresh. Returns that failure, for falling back, or None: then the budget's
        ``InfeasibleBudgetError`` is the compiler path's to raise. (Otherwise the compiler path's floor was
        reported, and a budget at that floor then fell back to the executor, whose floor may be higher:
        Canine, PegasusX.)"""
        if self._fallback is None:
            return None
        backend, graphs, asked = self._backend, len(self._backend.graphs), self._backend.on_infeasible
        backend.on_infeasible = "floor"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", InfeasibleBudgetWarning)
                self._trial(key, args, kwargs)
        except InfeasibleBudgetError:
            return None
        except RecomputeError as error:
            return error
        finally:
            backend.on_infeasible = asked
            self._steps.pop(key, None)
            del self._lowerings[lowered:], backend.graphs[graphs:]
        return None

    def _fall_back(self, error: RecomputeError) -> None:
        """Hand every later call to the fallback module, with a warning that says why; without a
        fallback, raise ``error``."""
        if self._fallback is None:
            raise error
        reason = str(error).removesuffix(_EXECUTOR_ADVICE)
        warnings.warn(f"{self._original_class}: the compiler path failed ({reason}); planning with the "
                      "schedule executor instead", CompilerFallbackWarning, stacklevel=user_stacklevel())
        object.__setattr__(self, "delegate", self._fallback())

    def _step_for(self, key: tuple) -> Callable[..., Any]:
        """The compiled call of one signature: ``torch.compile`` of a call of the model in a code object
        of its own (:func:`_own_code_call`), so that its compiled code is this signature's alone."""
        if key not in self._steps:
            call = _own_code_call(self._original)
            compiled = torch.compile(call, backend=self._backend, fullgraph=True, dynamic=False)
            ignored = ignored_logging_calls()  # once, not on every training call

            def step(*args: Any, **kwargs: Any) -> Any:
                with logging_calls_ignored(ignored):
                    return compiled(*args, **kwargs)
            step.code = call.__code__  # (Dynamo's guard failures are kept by code object)
            self._steps[key] = step
        return self._steps[key]

    def _trial(self, key: tuple, args: tuple, kwargs: dict) -> None:
        """The model's own forward, then one compiled forward, both in training mode with grad, undone
        (``model_state.preserved_state``: buffers by value, the random generators), outputs dropped.
        The own forward says how its output is built and whether it carries the model's own loss
        (``losses.own_loss``), which the compiled graph's flat outputs cannot say, for pricing the loss
        (``joint_allocations.own_output_known``), and what the compiled forward must draw and compute
        (:meth:`_check_random_draws`). Errors of the compiler come out as the library's own."""
        was_training = self.training
        self.train(True)
        outside = OutsideContainers(self._original)  # (lists a forward fills: planning's runs leave nothing there)
        try:
            own = self._own_forward(args, kwargs, outside)
            self._own_outputs[key] = own[2] if own is not None else None
            with preserved_state(self._original, rng=True), torch.enable_grad(), full_collections_deferred(), \
                    outside.put_back():
                drawn_from = generator_states()
                with own_output_known(self._own_outputs[key]):
                    output = _floating_values(self._step_for(key)(*args, **kwargs))
                compiled_draws = generator_states()
            if own is not None:
                self._check_random_draws(output, drawn_from, compiled_draws, *own[:2])
        except TorchDynamoException as error:
            raise _library_error(error, self._original_class) from error
        finally:
            self.train(was_training)

    def _own_forward(self, args: tuple, kwargs: dict, outside: OutsideContainers
                     ) -> "tuple[list[torch.Tensor], list[torch.Tensor], OutputStructure] | None":
        """The model's own forward, undone: its floating-point outputs, the generators' states after it,
        and its output's structure (whether it returned its own loss; what the loss is priced on); None
        on meta tensors (nothing runs). ``ChangingStateError`` when the forward changes a plain Python
        value at every call (a second run changes it again: ``model_state.changed_again``), for which
        Dynamo would compile again at each step."""
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0]):
            return None
        with preserved_state(self._original, rng=True, watch_parameters=True), torch.enable_grad(), \
                full_collections_deferred():
            before = PlainValues(self._original)
            with outside.recording(), replaced_submodules_refused(self._original):
                output = self._original(*args, **kwargs)
            held = [*tree_flatten((args, kwargs))[0], *self._original.parameters(), *self._original.buffers()]
            structure = OutputStructure.of(output, held, own_loss(output) is not None)
            expected = _floating_values(output)
            del output, held
            drawn = generator_states()
            with outside.recording():
                changed = changed_again(self._original, before, lambda: self._original(*args, **kwargs))
            outside.take_out()  # (what both runs put into lists outside the model)
            if changed:
                raise ChangingStateError(changing_state_message(self._original_class, changed,
                                                                _RECOMPILED_PER_VALUE))
            return expected, drawn, structure

    def _check_random_draws(self, output: list[torch.Tensor], drawn_from: list[torch.Tensor],
                            compiled_draws: list[torch.Tensor], expected: list[torch.Tensor],
                            eager_draws: list[torch.Tensor]) -> None:
        """CaptureError when the model's own forward (run from the generators' states ``drawn_from``,
        undone: ``expected``, its floating-point outputs, and ``eager_draws``, the states after it)
        leaves them elsewhere than the compiled forward did (``compiled_draws``), or, drawing random
        numbers, computes other outputs (``output``: the compiled forward's floating-point ones).
        torch.compile drops a random op whose result nothing reads (an unused dropout) as dead code, and
        its decomposition of an in-place dropout on a non-contiguous view fills the mask in another
        element order; either way the dropouts would draw other masks than eager PyTorch, even with no
        recomputation."""
        if not _same_states(eager_draws, compiled_draws):
            raise CaptureError(
                f"{self._original_class} draws other random numbers in its compiled forward than in its own: "
                "torch.compile drops a random op whose result nothing reads (an unused dropout) as dead code, "
                "so later dropouts would draw other masks. Remove the unused call, or plan with the schedule "
                "executor (compiler=False), whose graph keeps it.")
        if _same_states(eager_draws, drawn_from):  # no random numbers: the outputs are not compared
            return
        for a, b in zip(expected, output):
            scale = float(a.abs().max()) if a.numel() else 0.0
            if a.shape != b.shape or (a.numel() and float((a - b).abs().max()) > 1e-3 * max(scale, 1.0)):
                raise CaptureError(
                    f"{self._original_class} draws other random numbers in its compiled forward than in its "
                    "own: under the same seed its compiled output differs (a known cause: torch.compile's "
                    "decomposition of an in-place dropout on a non-contiguous view fills the mask in another "
                    "order). Apply the dropout out of place or on a contiguous tensor, or plan with the "
                    "schedule executor (compiler=False).")

    @torch.compiler.disable(reason=OUTER_COMPILE_REASON)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_call(args, kwargs)
        if not self._trains(args, kwargs):
            return self._original(*args, **kwargs)
        if self.delegate is None and _dispatch_mode_blocks_compile():
            warnings.warn(f"{self._original_class}: a torch dispatch mode is active, and torch.compile does "
                          "not run under one: this call runs the model's plain forward, without the plan",
                          CompilerFallbackWarning, stacklevel=user_stacklevel())
            return self._original(*args, **kwargs)
        self.plan(*args, **kwargs)
        if self.delegate is not None:
            return self.delegate(*args, **kwargs)
        key, lowered = self._current, len(self._lowerings)
        watch = self._watch(key, args, kwargs)
        try:
            with own_output_known(self._own_outputs.get(key)):  # a recompilation prices the loss alike
                output = self._step_for(key)(*args, **kwargs)
            if len(self._lowerings) > lowered:  # a recompilation (a guard Dynamo added) planned again
                self._planned[key] = self._lowerings[-1]
                self._warn_of_recompilation(key)
                if watch is not None:  # its pricing ran inside the watched step: the next step is judged
                    self._watched.discard(key)
                    watch = None
            if watch is not None:
                _finish_after_backward(output, watch)
            return output
        except TorchDynamoException as error:
            failure = _library_error(error, self._original_class)
            failure.__cause__ = error
        except FailOnRecompileLimitHit as error:
            failure = CaptureError(
                f"{self._original_class}: Dynamo compiled this call torch._dynamo.config.recompile_limit "
                f"({torch._dynamo.config.recompile_limit}) times, last because {self._failed_guard(key)}")
            failure.__cause__ = error
        if isinstance(failure, InfeasibleBudgetError):
            raise failure
        self._fall_back(failure)  # Dynamo failed before the step ran: nothing of it happened
        return self.delegate(*args, **kwargs)

    def _failed_guard(self, key: tuple) -> str:
        """The last guard of Dynamo's that failed for the compiled call of ``key``, and where the model
        reads it (``model.scale == 1.0  # x * self.scale  # model.py:12 in forward``)."""
        failures = getattr(torch._dynamo.utils, "guard_failures", {}).get(self._steps[key].code, [])
        lines = [f.strip().splitlines()[0] for f in failures if f.strip()]
        if not lines:
            return "one of its guards failed"
        newest = max(lines, key=_cache_entry)  # ("0/7: model.tau == 0.65  # x = l(x) / s.tau  # m.py:9 in forward")
        parts = [" ".join(part.split()) for part in newest.split(": ", 1)[-1].split("#")]
        where = f" (read at {parts[-1]}: {parts[1]})" if len(parts) > 2 else ""
        return f"its guard {parts[0]} failed{where}"[:400]

    def _warn_of_recompilation(self, key: tuple) -> None:
        """A ``RecompilationWarning`` the first time Dynamo compiles (and the backend plans) a planned call
        signature again."""
        if key in self._recompiled:
            return
        self._recompiled.add(key)
        warnings.warn(
            f"{self._original_class}: torch.compile compiled this training call again, and it was planned again: "
            f"{self._failed_guard(key)}. When a Python number the model reads (a temperature, a schedule's "
            "factor) changes between steps, each new value costs a capture and a planning, and after "
            f"torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) compilations the "
            "schedule executor takes over. Keep such a value in a tensor (a buffer, set with .fill_(value)), "
            "which no guard reads by value.", RecompilationWarning, stacklevel=user_stacklevel())

    def _watch(self, key: tuple, args: tuple, kwargs: dict) -> PeakWatch | None:
        """On CUDA, the first step of each signature is checked against its plan's budget (as the
        executor's: ``optimized_module.PeakWatch``, a ``BudgetExceededWarning`` when over)."""
        device = _cuda_device([*args, *kwargs.values()])
        if device is None or key in self._watched:
            return None
        self._watched.add(key)
        watch = PeakWatch(device, self._planned[key].plan.budget_bytes, self._original_class)
        watch.start()
        return watch

    def extra_repr(self) -> str:
        if self.delegate is not None:
            return f"{self._original_class}, the compiler path failed: {self.delegate.extra_repr()}"
        plan = self.recompute_plan
        return (f"{self._original_class}, compiled, plan: "
                f"{plan.one_line() if plan is not None else 'on first training call'}")


def _cache_entry(guard_failure: str) -> int:
    """The cache entry a line of Dynamo's guard failures is of: 7 in ``0/7: model.tau == 0.65 ...``."""
    entry = guard_failure.split(":", 1)[0].rsplit("/", 1)[-1]
    return int(entry) if entry.isdigit() else -1


def _dispatch_mode_blocks_compile() -> bool:
    """Whether a torch dispatch mode is active that Dynamo would not compile under (it skips the frame
    and ``fullgraph=True`` raises): a ``FlopCounterMode``, a memory tracker."""
    from torch.utils import _python_dispatch as dispatch
    if getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False):
        return dispatch.any_torch_dispatch_mode_on_stack()
    check = getattr(dispatch, "is_in_any_mode_without_ignore_compile_internals", None)
    return check() if check is not None else dispatch.is_in_torch_dispatch_mode(include_infra_modes=False)


def _finish_after_backward(output: Any, watch: PeakWatch) -> None:
    """Have ``watch.finish()`` run once, when the backward pass that reaches any of ``output``'s tensors
    ends (a callback the autograd engine runs after the whole graph, queued from a tensor hook)."""
    queued: list[bool] = []

    def hook(gradient: torch.Tensor) -> None:
        if not queued:
            queued.append(True)
            Variable._execution_engine.queue_callback(watch.finish)
    for value in tree_flatten(output)[0]:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.register_hook(hook)


def _floating_values(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output, detached."""
    return [t.detach() for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _same_states(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(map(torch.equal, a, b))


def _own_code_call(model: nn.Module) -> Callable[..., Any]:
    """``model(*args, **kwargs)`` as a function whose code object is new. Dynamo keeps compiled code,
    and counts recompilations against ``torch._dynamo.config.recompile_limit`` (8), per code object:
    compiling ``model`` itself would share them with every other instance of its class (the ninth
    ``nn.Sequential`` optimized in one process failed with ``FailOnRecompileLimitHit``), and keep
    them after the module is gone. A code object of its own is freed with the call."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)
    call.__code__ = call.__code__.replace()
    return call


def ignored_logging_calls() -> set:
    """``logging.Logger``'s methods, and those other libraries add to it (``transformers``'
    ``warning_once``), with Dynamo's own ignored functions: the compiled step treats them as no-ops, as
    ``torch.export`` does, instead of breaking the graph (GPT-2's loss logs a warning inside the
    forward). A message logged inside the forward is not emitted on the compiler path."""
    methods = {getattr(logging.Logger, name) for name in dir(logging.Logger)
               if name in _LOGGING_METHODS or name.endswith("_once")}
    return set(torch._dynamo.config.ignore_logging_functions) | {m for m in methods if callable(m)}


@contextlib.contextmanager
def logging_calls_ignored(ignored: set) -> Iterator[None]:
    """Compile with Dynamo treating ``ignored`` (:func:`ignored_logging_calls`) as no-ops. Torch 2.11's
    Dynamo then fails to log its compilation metrics (it writes its config as JSON, and this set of
    functions is not on its list of keys to leave out; torch 2.13's is), and logs that failure with a
    traceback at every compilation. That one record is dropped while the block runs."""
    metrics_log = logging.getLogger("torch._dynamo.metrics_context")
    metrics_log.addFilter(_drop_metrics_failure)
    try:
        with torch._dynamo.config.patch(ignore_logging_functions=ignored):
            yield
    finally:
        metrics_log.removeFilter(_drop_metrics_failure)


def _drop_metrics_failure(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(("Unexpected exception logging compilation metrics",
                                               "Unexpected exception logging runtime metrics"))


_LOGGING_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"})


def _library_error(error: Exception, model_name: str) -> Exception:
    """The library's error inside Dynamo's wrapper (``InfeasibleBudgetError`` ...), or a
    ``CaptureError`` saying why the model could not be captured whole."""
    inner = getattr(error, "inner_exception", None)
    for candidate in (inner, error):
        if isinstance(candidate, RecomputeError):
            return candidate
    cause = inner if inner is not None else error
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return CaptureError(f"{model_name} could not be compiled and planned as one graph ({type(cause).__name__}: "
                        f"{(lines[0] if lines else '')[:300]}){_EXECUTOR_ADVICE}")


_RECOMPILED_PER_VALUE = ("Dynamo would compile the model again (and this library plan it again) for each new value, "
                         "until its recompile_limit stops the compiled call")
_EXECUTOR_ADVICE = (". Use optimize(..., compiler=False) for the schedule executor, or compiler='auto' (the "
                    "default) to fall back to it with a warning.")
