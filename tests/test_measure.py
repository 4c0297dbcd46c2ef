"""The memory meter against hand-computed activation sizes of an MLP chain and torch.utils.checkpoint.

MLPChain(D, W): D x (Linear(W, W) -> ReLU) then Linear(W, O); batch B, float32; one activation is
``act = B * W * 4`` bytes. ReLU saves its output and the next Linear saves that same tensor as its input,
so a store-all forward keeps exactly one activation per layer (the model input is not counted).
The loss is a plain sum, whose gradient is a broadcast scalar owning no memory.
"""
import os
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import models_zoo
from recompute_graph.measure import (StorageTracker, default_loss, make_training_step, peak_memory,
                                     saved_tensor_bytes, sum_loss, time_step, time_steps_in_turn)

D, W, B, O, K = 8, 64, 2048, 4, 2
ACT = B * W * 4
HEAD_GRADS = O * W * 4 + O * 4
LOSS = 4 + 4  # the loss scalar and its seed gradient


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return models_zoo.MLPChain(D, W, None, O), torch.randn(B, W)


def test_store_all_forward_peaks_at_one_activation_per_layer_plus_the_last_linear_output(mlp):
    model, x = mlp
    kept = []
    # during the last ReLU: D-1 saved ReLU outputs, the last Linear's output and the new ReLU output
    assert peak_memory(lambda: kept.append(model(x))) == (D + 1) * ACT
    with StorageTracker() as tracker:
        out = model(x)
    assert tracker.live_bytes == D * ACT + B * O * 4
    assert saved_tensor_bytes(lambda: model(x)) == D * ACT


def test_store_all_training_step_peaks_at_activations_plus_two_gradients(mlp):
    model, x = mlp
    # first ReLU backward: D saved activations, the gradient of the last ReLU output and of its input,
    # the head's parameter gradients and the loss scalar
    assert peak_memory(make_training_step(model, (x,), sum_loss)) == (D + 2) * ACT + HEAD_GRADS + LOSS


def test_checkpointing_every_k_layers_lowers_the_peak_as_expected(mlp):
    model, x = mlp
    layers = list(model.layers)
    segments = [nn.Sequential(*layers[2 * K * i: 2 * K * (i + 1)]) for i in range(D // K)]

    def forward():
        h = x
        for segment in segments:
            h = checkpoint(segment, h, use_reentrant=False)
        return layers[-1](h)

    with StorageTracker() as tracker:
        out = forward()
    assert tracker.live_bytes == (D // K) * ACT + B * O * 4  # only segment boundaries are kept

    def step():
        model.zero_grad(set_to_none=True)
        forward().sum().backward()

    # backward of one segment: boundaries, the K recomputed activations and one gradient
    checkpointed = peak_memory(step, meter="storage")
    assert checkpointed == (D // K + K + 1) * ACT + HEAD_GRADS + LOSS
    assert checkpointed < peak_memory(make_training_step(model, (x,), sum_loss))


def test_storages_live_before_the_step_are_not_counted():
    weight = torch.randn(256, 256)
    assert peak_memory(lambda: (weight.t()[::2].unsqueeze(0), weight.add_(1)), meter="storage") == 0
    assert peak_memory(lambda: torch.empty(1000, dtype=torch.float64), meter="storage") == 8000
    # the allocator also sees the wrapped scalar of ``add_(1)``, a few bytes
    assert peak_memory(lambda: weight.add_(1)) <= 16
    assert peak_memory(lambda: torch.empty(1000, dtype=torch.float64)) == 8000


def test_the_allocator_meter_sees_kernel_temporaries_the_storage_tracker_cannot():
    conv = torch.nn.Conv2d(8, 8, 3)
    x = torch.randn(2, 8, 32, 32)
    step = make_training_step(conv, (x,), sum_loss)
    step()
    allocator, storage = peak_memory(step), peak_memory(step, meter="storage")
    assert allocator > storage  # the CPU convolution's im2col/mkldnn buffers


def test_the_allocator_meter_charges_a_step_for_what_it_allocates_after_freeing_old_gradients():
    weight = torch.nn.Parameter(torch.randn(1000))

    def step():
        weight.grad = None              # frees last step's 4000-byte gradient
        (weight * 2).sum().backward()   # then the product (4000, dead after the sum) and the gradient
    step()
    # netting the freed gradient against the new one would give about 20 bytes
    assert 4000 <= peak_memory(step) <= 4100
    with pytest.raises(ValueError, match="meter"):
        peak_memory(step, meter="tape")


def test_the_cuda_meter_reads_the_allocators_trace_as_the_cpu_meter_reads_its_events(monkeypatch):
    """No GPU here: the caching allocator is played by a script. The step frees last step's 4000-byte
    gradient, then allocates a 4000-byte product and a new 4000-byte gradient, and frees the product.
    ``max_memory_allocated`` minus the level before nets the freed gradient (4096 bytes read); the trace
    charges the step for what it allocates, each block rounded up to 512 bytes."""
    import recompute_graph.measure as measure
    trace = [{"action": "free_requested", "size": 4000}, {"action": "free_completed", "size": 4000},
             {"action": "alloc", "size": 4000}, {"action": "segment_alloc", "size": 2 << 20},
             {"action": "alloc", "size": 4000}, {"action": "free_completed", "size": 4000}]
    recording = []
    cuda = torch.cuda
    for name, value in [("synchronize", lambda device=None: None), ("current_device", lambda: 0),
                        ("reset_peak_memory_stats", lambda device=None: None),
                        ("memory_allocated", lambda device=None: 4000),
                        ("max_memory_allocated", lambda device=None: 4000 + 4096)]:
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(cuda.memory, "_record_memory_history", lambda enabled="all", **kw: recording.append(enabled))
    monkeypatch.setattr(cuda.memory, "_snapshot", lambda device=None: {"device_traces": [trace]})
    steps = []
    assert measure.peak_memory(lambda: steps.append(1), device="cuda:0") == 2 * 4096
    assert steps == [1] and recording == ["all", None]  # the step ran once, inside the recording
    assert measure.trace_peak_bytes(trace[:3]) == 4096 and measure.trace_peak_bytes([]) == 0
    monkeypatch.setattr(measure, "CUDA_TRACE_EVENTS", len(trace))  # a full trace may have lost events
    assert measure.peak_memory(lambda: None, device="cuda:0") == 4096


def test_peak_is_the_maximum_of_live_bytes_not_the_sum_of_allocations():
    def step():
        for _ in range(5):
            a = torch.ones(1000)
            del a
    assert peak_memory(step) == 4000


def test_time_step_runs_warmup_then_repeats():
    calls = []
    timing = time_step(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and len(timing.seconds) == 4 and timing.median_seconds >= 0
    assert "4 runs" in repr(timing)
    with pytest.raises(ValueError, match="repeats"):
        time_step(lambda: None, repeats=0)


def test_steps_timed_in_turn_interleave_rounds_after_warmup():
    calls = []
    timings = time_steps_in_turn([lambda: calls.append("a"), lambda: calls.append("b")], rounds=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert [len(t.seconds) for t in timings] == [3, 3] and all(min(t.seconds) >= 0 for t in timings)
    with pytest.raises(ValueError, match="rounds"):
        time_steps_in_turn([lambda: None], rounds=0)


def test_losses_cover_every_floating_tensor_of_nested_outputs():
    out = {"a": torch.ones(2, 3), "b": (torch.full((2,), 2.0), torch.arange(3))}
    assert sum_loss(out).item() == 10.0
    assert default_loss(out).item() == 6 + 8
    with pytest.raises(ValueError, match="no floating-point"):
        default_loss((torch.arange(3),))


def test_default_loss_sends_back_a_gradient_as_large_as_the_output():
    out = torch.randn(64, 32, requires_grad=True)
    def step():
        default_loss(out).backward()
    assert peak_memory(step) >= 64 * 32 * 4
    assert torch.equal(out.grad, out.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_meter_sees_the_same_activations(mlp):  # pragma: no cover - GPU only
    model, x = mlp
    model, x = model.cuda(), x.cuda()
    kept = []
    measured = peak_memory(lambda: kept.append(model(x)), device="cuda")
    assert measured == pytest.approx((D + 1) * ACT, rel=0.01)


def test_garbage_collected_during_a_step_does_not_hide_what_the_step_holds():
    """A reference cycle left by earlier profiled work, freed by the collector in the middle of the step,
    used to count as the step's lowest point: everything the step held before it was missed (ResNet-152
    read 251 MiB for a 409 MiB step in scripts/bench_baselines.py). The collector is held off now."""
    import gc

    from recompute_graph.measure import AllocatorRecorder, allocator_peak_memory

    class Cycle:
        def __init__(self):
            self.me, self.payload = self, torch.empty(10 * 2**20, dtype=torch.uint8)

    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(10**9)  # no collection until the step asks for one
    try:
        with AllocatorRecorder():  # earlier profiled work (a pricing pass): its frees are reported later
            Cycle()  # garbage at once, in the youngest generation
        held = []

        def step():
            held.append(torch.empty(2**20, dtype=torch.uint8))
            gc.set_threshold(1)  # the collector's turn comes here, as it may in any step
            junk = [[] for _ in range(10)]
            del junk
            held.append(torch.empty(2**20, dtype=torch.uint8))
        assert allocator_peak_memory(step) >= 2 * 2**20
    finally:
        gc.set_threshold(*thresholds)


def test_the_profilers_start_and_stop_lines_are_dropped_from_stderr_and_other_lines_kept(capfd):
    from recompute_graph.measure import AllocatorRecorder, _profiler_notes_dropped
    with _profiler_notes_dropped():
        os.write(2, b"USDT:2026-12-06 17:29:34 15896:15896 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning of someone else's\n")
        os.write(2, b"[W1206 17:36:42.030428179 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
                    b"before the profiling started, profiler results will not include the deallocation event\n")
    with AllocatorRecorder() as recorder:
        torch.ones(1000) + 1
    assert recorder.peak_bytes() >= 4000
    assert capfd.readouterr().err == "a warning of someone else's\n"


def test_a_saved_storage_freed_and_its_address_reused_is_not_counted():
    """A storage's key is its address, which a later storage reuses once the first is freed: ``max``'s
    indices, saved by a backward that dies with the unused values, were counted when a tensor made after
    them took their address (16896 bytes for 16384 in CI, depending on what ran before). The tracker's
    serial tells the two apart."""
    import torch
    from recompute_graph.measure import StorageTracker, saved_tensor_bytes, storage_key

    weight = torch.randn(32, 32, requires_grad=True)

    def run():
        x = torch.randn(64, 32) @ weight  # saves the input (8192 bytes)
        x.max(1)  # saves the indices (512 bytes) for a backward that dies with the unused values, here
        return x, [torch.empty(64, dtype=torch.long) for _ in range(64)]  # (likely at the indices' address)
    assert saved_tensor_bytes(run) == 64 * 32 * 4
    with StorageTracker() as tracker:
        first = torch.empty(64, dtype=torch.long)
        key, serial = storage_key(first), tracker.serial[storage_key(first)]
        del first
        again = [torch.empty(64, dtype=torch.long) for _ in range(64)]
        assert tracker.serial.get(key) != serial and again
