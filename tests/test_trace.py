"""Tracing survives the patterns real models use; untraceable parts become opaque nodes."""

import pytest
import torch
from torch import nn

import models_zoo
from recompute_graph import TraceError, RecomputeError
from recompute_graph.costs import profile_model
from recompute_graph.measure import saved_tensor_bytes
from recompute_graph.trace import trace


def snapshot(model: nn.Module):
    return (set(vars(model)), {k: v.clone() for k, v in model.state_dict().items()}, model.training,
            [type(m).forward for m in model.modules()], [dict(m._forward_hooks) for m in model.modules()],
            [set(vars(m)) for m in model.modules()])


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after[0] == before[0] and after[2:] == before[2:]
    assert after[1].keys() == before[1].keys()
    assert all(torch.equal(after[1][k], before[1][k]) for k in before[1])


def check_traces_faithfully(model: nn.Module, *inputs, opaque=()):
    """Traced module computes what the model computes; profiling prices it and matches autograd."""
    before = snapshot(model)
    result = trace(model)
    assert result.opaque_modules == tuple(opaque)
    torch.manual_seed(3)
    expected = model(*inputs)
    torch.manual_seed(3)
    actual = result.graph_module(*inputs)
    torch.testing.assert_close(actual, expected)
    _, graph = profile_model(model, inputs, timing="flops")
    assert graph.store_all_saved_bytes() == saved_tensor_bytes(lambda: model(*inputs))
    assert_unchanged(model, before)
    return result, graph


class ShapeConstructors(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        bias = torch.zeros(x.shape[0], 6, dtype=x.dtype, device=x.device)
        steps = torch.arange(x.size(1), device=x.device).to(x.dtype)
        return self.linear(x) + bias + torch.ones(x.shape[0], x.shape[1]) * steps


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 12)

    def forward(self, x):
        y = self.linear(x).view(x.shape[0], 3, 4).permute(0, 2, 1).reshape(x.shape[0], -1)
        return y.transpose(0, 1).contiguous().t()[:, 2:].tanh()


class CatOverList(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(4, 3) for _ in range(3)])

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=1).sigmoid()


class SharedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 5)

    def forward(self, x):
        return self.layer(torch.relu(self.layer(self.layer(x))))


class TiedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return torch.log_softmax(self.out(self.embed(tokens).tanh()), dim=-1)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.a(x))
        z = self.b(y)
        z += y
        return z.mul_(2).sigmoid_()


class TupleAndDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return {"logits": h.exp(), "pair": (h.sin(), h.cos())}


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
            return self.proj(x).relu()
        return self.proj(-x).relu()


class WithOpaquePart(nn.Module):
    def __init__(self):
        super().__init__()
        self.before, self.gate, self.after = nn.Linear(4, 4), DataDependent(), nn.Linear(4, 4)

    def forward(self, x):
        return self.after(self.gate(self.before(x).tanh()).tanh())


class UntraceableRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        for row in range(int(x[0, 0].item() > 0) + 1):  # .item() on a traced value
            x = self.a(x)
        return x


def test_tensor_constructors_sized_from_an_input_shape():
    result, graph = check_traces_faithfully(ShapeConstructors(), torch.randn(3, 6))
    targets = {n.target for n in graph}
    assert {"torch.zeros", "torch.arange", "torch.ones"} <= targets
    # a constructor reads only the input's shape, so it has no data predecessor
    assert graph[[n.target for n in graph].index("torch.zeros")].predecessors == ()


def test_views_reshapes_and_permutes_own_no_storage():
    _, graph = check_traces_faithfully(Views(), torch.randn(5, 12))
    views = [n for n in graph if n.target in ("view", "permute", "transpose", "t", "_operator.getitem")]
    assert views and all(n.output_bytes == 0 and n.alias_of is not None for n in views)
    reshape = graph[[n.target for n in graph].index("reshape")]
    assert reshape.output_bytes > 0  # reshape of a permuted tensor must copy


def test_cat_over_a_list_has_every_branch_as_predecessor():
    _, graph = check_traces_faithfully(CatOverList(), torch.randn(2, 4))
    cat = graph[[n.target for n in graph].index("torch.cat")]
    assert len(cat.predecessors) == 3 and cat.output_bytes == 2 * 9 * 4


def test_module_called_several_times_is_one_node_per_call_and_grads_are_charged_once():
    model = SharedModule()
    _, graph = check_traces_faithfully(model, torch.randn(3, 5))
    calls = [n for n in graph if n.target == "layer"]
    assert len(calls) == 3
    assert sum(n.param_grad_bytes for n in graph) == sum(p.numel() * 4 for p in model.parameters())
    assert calls[-1].param_grad_bytes > 0 and calls[0].param_grad_bytes == 0


def test_tied_weights_are_one_parameter():
    model = TiedWeights()
    _, graph = check_traces_faithfully(model, torch.randint(0, 11, (2, 7)))
    assert graph.parameter_bytes == 11 * 6 * 4
    assert sum(n.param_grad_bytes for n in graph) == 11 * 6 * 4


def test_in_place_activations_and_augmented_assignment_are_functionalized():
    model = InPlace()
    result, graph = check_traces_faithfully(model, torch.randn(3, 4))
    assert set(result.functionalized) == {"relu", "iadd", "mul_", "sigmoid_"}
    assert model.relu.inplace, "the user's module keeps inplace=True"
    assert not any(n.inplace for n in graph)
    assert all(graph[name].output_bytes == 3 * 4 * 4 and graph[name].alias_of is None
               for name in ("relu", "iadd", "mul_", "sigmoid_"))


def test_tuple_and_dict_outputs():
    model = TupleAndDict()
    result = trace(model)
    x = torch.randn(2, 4)
    out = result.graph_module(x)
    assert set(out) == {"logits", "pair"} and isinstance(out["pair"], tuple)
    torch.testing.assert_close(out, model(x))
    _, graph = profile_model(model, (x,), timing="flops")
    assert graph.store_all_saved_bytes() == saved_tensor_bytes(lambda: model(x))


def test_data_dependent_submodule_becomes_one_opaque_node_and_the_rest_stays_fine_grained():
    model = WithOpaquePart()
    result, graph = check_traces_faithfully(model, torch.randn(2, 4), opaque=("gate",))
    assert "x.sum() > 0" in result.opaque_reasons[0] and "test_trace.py" in result.opaque_reasons[0]
    kinds = {n.target: n.kind for n in graph}
    assert kinds["gate"] == "opaque" and graph["gate"].opaque
    assert kinds["before"] == kinds["after"] == "module" and "tanh" in kinds


def test_zoo_models_need_no_opaque_node(zoo_name):
    model, _ = models_zoo.get_model(zoo_name, "tiny")
    assert trace(model).opaque_modules == ()


def test_untraceable_root_raises_trace_error_naming_module_and_line_and_leaves_model_alone():
    model = UntraceableRoot()
    before = snapshot(model)
    with pytest.raises(TraceError) as info:
        trace(model)
    error = info.value
    assert isinstance(error, RecomputeError)
    assert "UntraceableRoot" in str(error) and "test_trace.py" in error.source_location
    assert "x[0, 0].item()" in str(error)
    assert_unchanged(model, before)
    torch.testing.assert_close(model(torch.ones(1, 4)), model(torch.ones(1, 4)))


def test_non_module_is_rejected():
    with pytest.raises(TraceError, match="nn.Module"):
        trace(lambda x: x)


class ReadsAfterInPlace(nn.Module):
    """``x.add_(1)`` then reading ``x``: readers must see the updated values after functionalization."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        before = h * 3          # reads h before the write
        h.add_(1)
        return h * 2 + before   # reads h after the write


def test_readers_after_an_in_place_write_read_the_written_value():
    model = ReadsAfterInPlace()
    result, graph = check_traces_faithfully(model, torch.randn(2, 4))
    assert result.functionalized == ("add_",)
    assert graph["mul_1"].predecessors == (graph["add_"].index,)


def test_in_place_writes_into_inputs_are_kept_in_place():
    class WritesInput(nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x + 1
    result = trace(WritesInput())
    assert result.functionalized == ()
    x = torch.ones(3)
    assert torch.equal(result.graph_module(x), torch.full((3,), 3.0)) and torch.equal(x, torch.full((3,), 2.0))


def test_tracing_in_a_fresh_interpreter_leaves_torch_compile_able_to_trace_the_swapped_constructors():
    """The trace swaps ``torch.arange``/``torch.ones`` for recording wrappers; a Dynamo table built
    during that window (first use of torch._dynamo) recorded the wrappers, so a later torch.compile of
    GPT-2 broke its graph at both constructors. Needs a fresh interpreter (the table is built once)."""
    import subprocess
    import sys
    script = (
        "import sys, torch\n"
        "import models_zoo\n"
        "from recompute_graph.trace import trace\n"
        "model, inputs = models_zoo.get_model('gpt2', 'tiny')\n"
        "trace(model)\n"
        "graphs = []\n"
        "def count(gm, example_inputs):\n"
        "    graphs.append(gm)\n"
        "    return gm\n"
        "torch.compile(model, backend=count)(*inputs)\n"
        "print(len(graphs))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "1", done.stderr[-2000:]


class _EncoderClassifier(nn.Module):
    """A transformer built from ``torch.nn``'s own layers, as tutorials build it."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 100)

    def forward(self, ids, padding):
        x = self.encoder(self.embedding(ids), src_key_padding_mask=padding)
        return self.head(self.attention(x, x, x, key_padding_mask=padding, need_weights=False)[0])


def test_torch_nn_transformer_layers_are_traced_into_and_recomputed_inside():
    """``nn.TransformerEncoder`` was one leaf node of the fx graph, holding every layer's activations:
    the executor's smallest plan was 0.95 of store-all. It is traced into now; its fast-path checks
    branch on tensors, so it becomes opaque and ``auto`` takes export's aten graph, in which the
    executor recomputes inside the layers. A single ``nn.MultiheadAttention`` stays a leaf."""
    import recompute_graph as rg
    result = trace(_EncoderClassifier())
    assert result.opaque_modules == ("encoder",)
    assert any(n.op == "call_module" and n.target == "attention" for n in result.graph_module.graph.nodes)
    ids = torch.randint(0, 100, (8, 32), generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(8, 32, dtype=torch.bool)
    padding[:, 24:] = True
    torch.manual_seed(0)
    report = rg.verify(_EncoderClassifier(), 0.6, example_inputs=(ids, padding), compiler=False)
    assert report.ok and report.gradient_error == 0.0 and report.solver != "store_all", report
    optimized = rg.optimize(_EncoderClassifier(), 0.6, example_inputs=(ids, padding), compiler=False)
    assert optimized.recompute_plan.recomputed_nodes and len(optimized.recompute_plan.graph.nodes) > 50


class _HostRandomMask(nn.Module):
    """Masks features with a mask drawn from numpy or Python's ``random`` (as wav2vec2's SpecAugment)."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        import random

        import numpy as np
        keep = np.random.rand(64) > 0.2 if self.source == "numpy" else [random.random() > 0.2 for _ in range(64)]
        return self.b(torch.relu(self.a(x)) * torch.tensor(keep, dtype=torch.float32))


@pytest.mark.parametrize("source", ["numpy", "python"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_random_numbers_drawn_outside_torch_are_refused_not_frozen(source, tracer):
    """Both tracers ran the draw once and held the mask as a constant: every step masked the same
    features, silently (the export check compares outputs only when the graph has torch random ops).
    The generators' states are put back."""
    import random

    import numpy as np
    import recompute_graph as rg
    states = random.getstate(), np.random.get_state()[1].copy()
    with pytest.raises(rg.TraceError, match=r"draws random numbers from Python's random module or numpy's"):
        rg.optimize(_HostRandomMask(source), 0.9, example_inputs=(torch.randn(32, 16),), compiler=False,
                    tracer=tracer)
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()


def test_a_layer_skipped_at_random_is_refused_with_what_to_change():
    """LayerDrop (wav2vec2's default ``layerdrop=0.1``) branches on a drawn tensor: no one graph holds
    the forward's ops. Export's error said to pass the inputs as training does, which does not help;
    torch.fx drew the branch once and kept it."""
    import recompute_graph as rg

    class LayerDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                if not (self.training and torch.rand([]) < 0.1):
                    x = torch.relu(layer(x))
            return x
    with pytest.raises(rg.TraceError, match=r"branches on a tensor's value there \(a layer skipped at random"):
        rg.optimize(LayerDrop(), 0.9, example_inputs=(torch.randn(8, 16),), compiler=False, tracer="export")
    # torch.fx ran torch.rand([]) (no traced input) while it traced, took the branch it drew, and kept
    # that one graph for every step: a layer dropped for good, silently. The draw is a node of the graph
    # now, and a branch on it in the root's own forward is control flow fx cannot trace
    model, x = LayerDrop(), torch.randn(8, 16)
    generator = torch.get_rng_state()
    with pytest.raises(rg.TraceError, match=r"cannot be used as inputs to control flow"):
        rg.optimize(model, 0.9, example_inputs=(x,), compiler=False, tracer="fx")
    assert torch.equal(torch.get_rng_state(), generator)


class _LayerDropEncoder(nn.Module):
    """transformers' M2M100 and NLLB-MoE: LayerDrop in an encoder the root calls, a dropout after it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.3:
                continue
            x = torch.tanh(layer(x))
        return x


class _WithLayerDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 128)
        self.encoder = _LayerDropEncoder()
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))

    def forward(self, x):
        noise = torch.randn(128) * 0.01  # noise of a fixed shape, drawn at every call
        return self.head(self.encoder(self.embed(x) + noise))


def test_layer_drop_in_a_submodule_draws_anew_at_each_step_and_trains_exactly():
    """``torch.rand([])`` deciding a branch inside the encoder was drawn once by torch.fx, which refused
    the model (M2M100, NLLB-MoE). Recorded as a node, the branch makes the encoder one opaque node,
    which draws at each step as eager PyTorch does, and recomputed replays its draws."""
    import recompute_graph as rg
    from recompute_graph.trace import trace
    model = _WithLayerDrop()
    traced = trace(model)
    assert traced.opaque_modules == ("encoder",) and "torch.randn" in traced.graph_module.code
    x = torch.randn(256, 16)
    for seed in (0, 1):
        report = rg.verify(model, 0.965, example_inputs=(x,), compiler=False, seed=seed)
        assert report.gradient_error < 1e-6 and report.measured_peak_bytes <= report.budget_bytes
    assert rg.optimize(model, 0.965, example_inputs=(x,), compiler=False).recompute_plan.recomputed_nodes


class _OwnGeneratorNoise(nn.Module):
    """Noise drawn from a ``torch.Generator`` the model holds (a reproducible augmentation), between
    layers a plan recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256))
        self.b = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4))
        self.generator = torch.Generator().manual_seed(1)

    def forward(self, x):
        h = self.a(x)
        return self.b(h * (torch.rand(h.shape, generator=self.generator) > 0.3))


def test_a_generator_the_model_holds_is_replayed_on_recomputation_and_untouched_by_planning():
    """fx keeps ``torch.rand(..., generator=self.generator)`` as a node: recomputing it drew other
    numbers than the forward had (the default generators alone were replayed), and planning's runs
    of the forward advanced the model's generator, so the first step drew other numbers than eager
    PyTorch. Gradients were off by 6e-3 of the largest, on ``optimize()``'s default path too (Dynamo
    cannot take a generator argument and falls back). Export's graph draws from the default generator."""
    import recompute_graph as rg
    from recompute_graph.verification import parameter_gradient_error
    torch.manual_seed(0)
    model = _OwnGeneratorNoise()
    torch.manual_seed(0)
    reference = _OwnGeneratorNoise()
    x = torch.randn(512, 64)
    state = model.generator.get_state()
    # the export graph does not draw from it: refused, saying why
    with pytest.raises(rg.TraceError, match=r"torch.Generator the model holds, _OwnGeneratorNoise \(generator\)"):
        rg.optimize(model, 0.7, example_inputs=(x,), compiler=False, tracer="export")
    optimized = rg.optimize(model, 0.7, example_inputs=(x,), compiler=False, tracer="fx")
    assert torch.equal(model.generator.get_state(), state)
    # fx keeps the generator as a constant of the graph module (``_opaque_obj0``), no longer on the model
    assert vars(model).keys() == vars(reference).keys()
    assert optimized.recompute_plan.recomputed_nodes
    for _ in range(2):
        for module in (optimized, reference):
            module.zero_grad()
            module(x).square().mean().backward()
        assert parameter_gradient_error(model, reference) == 0.0
        assert torch.equal(model.generator.get_state(), reference.generator.get_state())


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_random_numbers_from_a_numpy_generator_the_model_holds_are_refused(tracer):
    """``self.rng = np.random.default_rng(0)`` drawn from in ``forward``: the export graph held the
    mask it drew while tracing as a constant, silently (gradients 5e-3 off from the second step)."""
    import numpy as np
    import recompute_graph as rg

    class NumpyMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
            self.rng = np.random.default_rng(0)

        def forward(self, x):
            return self.b(self.a(x) * torch.from_numpy(self.rng.random((32, 16)) > 0.3).float())
    model = NumpyMask()
    state = model.rng.bit_generator.state
    with pytest.raises(rg.TraceError, match=r"a random generator the model holds, NumpyMask \(rng\)"):
        rg.optimize(model, 0.9, example_inputs=(torch.randn(32, 16),), compiler=False, tracer=tracer)
    assert model.rng.bit_generator.state == state


@pytest.mark.parametrize("source", ["torch", "numpy"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_generator_made_in_forward_is_refused(source, tracer):
    """``torch.Generator().manual_seed(0)`` or ``np.random.default_rng()`` made in ``forward``: the
    graph held one generator whose state ran on across steps (fx; the model's call restarts it) or the
    mask drawn while tracing (export, numpy), silently: gradients 2-3e-2 off from the first or second
    step. Refused, with the generator named."""
    import numpy as np
    import recompute_graph as rg

    class MadeInForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = self.a(x)
            if source == "torch":
                return self.b(h * (torch.rand(h.shape, generator=torch.Generator().manual_seed(0)) > 0.3))
            return self.b(h * torch.from_numpy(np.random.default_rng().random((32, 16)) > 0.3).float())
    made = r"a torch.Generator passed to rand" if source == "torch" else r"numpy.random.default_rng\(\)"
    with pytest.raises(rg.TraceError, match=rf"a generator it makes itself, {made}"):
        rg.optimize(MadeInForward(), 0.9, example_inputs=(torch.randn(32, 16),), compiler=False, tracer=tracer)


class _LossModuleMadeInForward(nn.Module):
    """transformers' heads write ``loss_fct = CrossEntropyLoss(); loss = loss_fct(logits, labels)``: a
    module that is not one of the model's submodules (torch.fx: ``NameError: module is not installed as a
    submodule``)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x, labels):
        logits = self.head(torch.relu(self.hidden(x)))
        loss_fct = nn.CrossEntropyLoss()
        return loss_fct(logits, labels), logits


def test_a_stateless_module_made_in_forward_is_traced_where_it_is_called_and_trains_exactly():
    import recompute_graph as rg
    torch.manual_seed(0)
    model, x, labels = _LossModuleMadeInForward(), torch.randn(64, 16), torch.randint(0, 10, (64,))
    graph = trace(model).graph_module.graph
    assert any("cross_entropy" in str(n.target) for n in graph.nodes)
    report = rg.verify(model, 1.0, example_inputs=(x, labels), compiler=False)
    assert report.gradient_error < 1e-6 and abs(report.prediction_error) <= 0.02


def test_a_module_with_parameters_made_in_forward_is_refused():
    class MadeWithWeights(nn.Module):
        def forward(self, x):
            return nn.Linear(4, 4)(x)
    with pytest.raises(TraceError, match="not installed as a submodule"):
        trace(MadeWithWeights())
