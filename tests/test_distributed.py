"""An optimized module under DistributedDataParallel and under FSDP2's ``fully_shard`` (gloo, 2 CPU
processes started by each test): its gradients equal those of the unoptimized model under the same
wrapper, step after step, and BatchNorm statistics match."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
STEPS = 2


def _train(wrapped, module, batches, full_tensor=lambda g: g) -> list:
    """SGD steps of ``wrapped`` (the DDP / FSDP2 view of ``module``); the gradients of every step."""
    from recompute_graph.measure import default_loss
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    grads = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        default_loss(wrapped(**batch) if isinstance(batch, dict) else wrapped(batch)).backward()
        grads.append([full_tensor(p.grad).clone() for p in module.parameters()])
        optimizer.step()
    return grads


def _assert_same_gradients(results: dict) -> None:
    for step in range(STEPS):
        for a, b in zip(results["reference"]["grads"][step], results["optimized"]["grads"][step]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _worker(rank: int, store_path: str, results_dir: str, compiler: bool = False) -> None:
    import copy

    import models_zoo
    from recompute_graph import optimize
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    try:
        model, _ = models_zoo.get_model("unet", "tiny", seed=0)  # same weights on every rank
        reference = copy.deepcopy(model)
        torch.manual_seed(100 + rank)  # different data on every rank
        batches = [torch.randn(2, 3, 32, 32) for _ in range(STEPS)]
        options = {"compiler": True} if compiler else {"timing": "flops"}
        optimized = optimize(model, 0.6, example_inputs=(batches[0],), **options)
        assert optimized.recompute_plan.recomputed_nodes
        results = {}
        for name, module in (("reference", reference), ("optimized", optimized)):
            grads = _train(DistributedDataParallel(module), module, batches)
            results[name] = {"grads": grads, "buffers": [b.clone() for b in module.buffers()]}
        torch.save(results, os.path.join(results_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("compiler", [False, True], ids=["executor", "compiler"])
def test_ddp_gradients_of_the_optimized_module_equal_the_unoptimized_ddp_run(tmp_path, compiler):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path), compiler), nprocs=WORLD_SIZE, join=True)
    for rank in range(WORLD_SIZE):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        _assert_same_gradients(results)
        for a, b in zip(results["reference"]["buffers"], results["optimized"]["buffers"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the gradients were averaged across ranks: both ranks hold the same ones
    first, second = (torch.load(tmp_path / f"rank{r}.pt")["optimized"]["grads"] for r in range(WORLD_SIZE))
    for a, b in zip(first[0], second[0]):
        torch.testing.assert_close(a, b)


def _fsdp_worker(rank: int, store_path: str, results_dir: str, compiler: bool = False,
                 transformers: bool = False) -> None:
    import copy

    import models_zoo
    from recompute_graph import optimize
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    try:
        if transformers:  # exported on the executor: its graph holds the parameters of its export
            from models_zoo import hf
            torch.manual_seed(0)
            model, _ = hf.gpt2(layers=2, width=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        else:
            model, _ = models_zoo.get_model("gpt2", "tiny", seed=0, dropout=0.0)
        reference = copy.deepcopy(model)
        torch.manual_seed(100 + rank)
        batches = [torch.randint(0, 97, (2, 32)) for _ in range(STEPS)]
        if transformers:
            batches = [{"input_ids": ids, "labels": ids} for ids in batches]
        options = {"compiler": True} if compiler else {"timing": "flops"}
        example = {"example_kwargs": batches[0]} if transformers else {"example_inputs": (batches[0],)}
        optimized = optimize(model, 0.75, **example, **options)
        assert optimized.recompute_plan.recomputed_nodes
        results = {}
        for name, module in (("reference", reference), ("optimized", optimized)):
            fully_shard(module)
            results[name] = {"grads": _train(module, module, batches, lambda g: g.full_tensor())}
        torch.save(results, os.path.join(results_dir, f"fsdp{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("compiler, transformers", [(False, False), (True, False), (False, True)],
                         ids=["executor", "compiler", "executor-transformers"])
def test_fsdp2_gradients_of_the_optimized_module_equal_the_unoptimized_fsdp2_run(tmp_path, compiler, transformers):
    """On the executor an exported ``transformers`` model got no gradients at all under FSDP2: its graph
    held the parameters of its export, not the unsharded ones FSDP2 puts in the model for the step
    (``PreparedStep.parameters_changed``)."""
    mp.spawn(_fsdp_worker, args=(str(tmp_path / "store"), str(tmp_path), compiler, transformers),
             nprocs=WORLD_SIZE, join=True)
    for rank in range(WORLD_SIZE):
        _assert_same_gradients(torch.load(tmp_path / f"fsdp{rank}.pt"))
