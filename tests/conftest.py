"""Shared fixtures: tiny zoo models and their cost graphs, profiled once per test session."""
from __future__ import annotations

import functools
import os

import hypothesis
import pytest
import torch

import models_zoo
from recompute_graph.costs import profile_model

# `make test` runs two pytest-xdist workers on the two cores (one thread each); a plain `pytest` uses both cores
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# `make test` (and so CI) draws the same hypothesis examples at every run: a failure there is one every run
# shows, not one a random draw found once. A plain `pytest`, and the hunts with `--hypothesis-seed=N` and a
# larger `max_examples` (tests/test_fuzz_compiled.py), draw at random.
hypothesis.settings.register_profile("suite", derandomize=True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    hypothesis.settings.load_profile("suite")

try:  # torchvision's CUDA wheel fails to import on CPU torch unless imported this way (third_party.py);
    # transformers and timm import it when it is installed, so it is imported first, once, here
    from models_zoo.third_party import import_torchvision
    import_torchvision()
except ImportError:
    pass


@functools.lru_cache(maxsize=None)
def profiled_tiny(name: str):
    """(model, example_inputs, trace_result, cost_graph) for zoo model ``name`` at the tiny preset,
    priced with deterministic FLOP-based times."""
    model, inputs = models_zoo.get_model(name, "tiny")
    traced, graph = profile_model(model, inputs, timing="flops")
    return model, inputs, traced, graph


#: ``optimize()``'s options for each of its paths: the schedule executor (FLOP-based times: deterministic
#: plans) and the compiler path (its default, ``compiler="auto"``, where capture works)
PATH_OPTIONS = {"executor": {"compiler": False, "timing": "flops"}, "compiler": {"compiler": True}}


@pytest.fixture(params=sorted(PATH_OPTIONS))
def path_options(request) -> dict:
    """``optimize()``'s options for one path; a test taking it runs on both."""
    torch._dynamo.reset()
    return dict(PATH_OPTIONS[request.param])


@pytest.fixture(params=models_zoo.MODEL_NAMES)
def zoo_name(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def short_ilp_solves(monkeypatch):
    """The ilp solver's default time limit, shortened for the suite (tests needing more pass their own)."""
    from recompute_graph.solvers import ilp
    monkeypatch.setattr(ilp, "DEFAULT_TIME_LIMIT", 5.0)
