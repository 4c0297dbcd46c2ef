"""Models outside the conformance set, tried as a new user would: ``rg.verify`` at half the activations.

    python scripts/outside_models.py [--timm NAME ...] [--torchvision NAME ...] [--hf CONFIG:TASK ...]
                                     [--fraction 0.5] [--timeout 400]

For each model, in a process of its own (one thread): build it untrained with small sizes, then
``rg.verify(model, fraction, ...)`` with ``optimize()``'s defaults (the compiler path, the executor as its
fallback), raised to the smallest feasible budget when the fraction is infeasible. One row per model:
the path, the solver, the gradients' error (of the largest gradient), measured against predicted peak
(allocator), within the budget or not, and any fallback warning or error.

``--timm NAME``: ``timm.create_model(NAME, num_classes=10)`` on a batch of 2 images, 64 x 64 (``img_size=64``
where the model takes it, else the first of 64, 96, 128 and its own size that runs).

``--torchvision NAME``: a torchvision builder with ``weights=None, num_classes=10``: a classification one
on 2 images (the first of 64, 96, 128 and 224 pixels that runs), a ``video`` one on 2 clips of 8 frames
(the first of 32, 64, 112 and 224 pixels), a ``segmentation`` one on 2 images of 64 pixels.

``--hf CONFIG:TASK``: ``transformers.{CONFIG}Config()`` (or the configuration of that ``model_type``,
``qwen3_next``) shrunk (two layers, width 32, four heads, ...) under the auto class of the task: ``clm``
(causal LM, labels), ``mlm`` (masked LM, labels), ``cls`` (sequence classification), ``s2s`` (seq2seq LM,
labels), ``img`` (image classification), on 2 x 32 tokens. ``CONFIG:TASK:key=value,...`` then sets those
keys on the configuration (JSON values: ``layer_types=["mamba","attention"]``), except
``attention_mask=padded``, which passes an attention mask with the second sequence padded after 24 tokens.

Session 48 ran 76 timm models and 69 transformers configurations, session 49 17 torchvision builders and
63 more configurations, session 50 the seq2seq models given labels that earlier sessions saw refused
(docs/benchmarks.md, "Models outside the conformance set").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_SHRINK = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, n_embd=32, n_layer=2, n_head=4,
               n_positions=128, head_dim=8, max_position_embeddings=128, ffn_dim=64, d_ff=64, d_kv=8, num_layers=2,
               num_heads=4, moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
               shared_expert_intermediate_size=32, embedding_size=32, n_routed_experts=4)


def _timm_model(name: str) -> tuple[torch.nn.Module, dict]:
    from models_zoo import third_party
    timm = third_party.import_timm()
    for options, size in ((dict(img_size=64), 64), ({}, 64), ({}, 96), ({}, 128), ({}, None)):
        torch.manual_seed(0)
        try:
            model = timm.create_model(name, pretrained=False, num_classes=10, **options)
        except TypeError:
            continue
        x = _batch((2, 3), size or model.pretrained_cfg.get("input_size", (3, 224, 224))[-1])
        if _runs(model, x):
            return model.train(), {"example_inputs": (x,)}
    raise RuntimeError(f"{name}: no input size runs")


def _batch(shape: tuple[int, ...], size: int) -> torch.Tensor:
    return torch.randn(*shape, size, size, generator=torch.Generator().manual_seed(0))


def _runs(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether ``model`` takes ``x`` (in eval mode, without gradients)."""
    try:
        with torch.no_grad():
            model.eval()(x)
    except Exception:  # noqa: BLE001 - a size the model does not take
        return False
    return True


def _torchvision_model(name: str) -> tuple[torch.nn.Module, dict]:
    from models_zoo import third_party
    models = third_party.import_torchvision().models
    for family, sizes, shape in ((models, (64, 96, 128, 224), (2, 3)), (models.video, (32, 64, 112, 224), (2, 3, 8)),
                                 (models.segmentation, (64,), (2, 3))):
        if name not in models.list_models(module=family):
            continue
        options = dict(weights_backbone=None) if family is models.segmentation else {}
        for size in sizes:
            torch.manual_seed(0)
            model, x = getattr(family, name)(weights=None, num_classes=10, **options), _batch(shape, size)
            if _runs(model, x):
                return model.train(), {"example_inputs": (x,)}
        raise RuntimeError(f"{name}: no input size runs")
    raise RuntimeError(f"{name}: not a torchvision classification, video or segmentation builder")


def _hf_model(spec: str) -> tuple[torch.nn.Module, dict]:
    from models_zoo import third_party
    third_party.import_timm()  # (transformers imports torchvision)
    import transformers
    transformers.logging.set_verbosity_error()
    config_name, task, *overrides = spec.split(":")
    if config_name in transformers.CONFIG_MAPPING:
        config = transformers.CONFIG_MAPPING[config_name]()
    else:
        config = getattr(transformers, config_name + "Config")()
    for key, value in _SHRINK.items():
        if hasattr(config, key) and not isinstance(getattr(config, key), (list, tuple)):
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001 - a read-only property of this configuration
                pass
    padded = False
    for key, value in re.findall(r"(\w+)=(\[[^\]]*\]|[^,]+)", ":".join(overrides)):
        if key == "attention_mask" and value == "padded":  # the call's, not the configuration's
            padded = True
            continue
        setattr(config, key, json.loads(value))
    if task == "s2s" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # (SwitchTransformers, LongT5)
    vocabulary = min(getattr(config, "vocab_size", 1000) or 1000, 1000)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocabulary, (2, 32), generator=generator)
    torch.manual_seed(0)
    auto = {"clm": "AutoModelForCausalLM", "mlm": "AutoModelForMaskedLM", "cls": "AutoModelForSequenceClassification",
            "s2s": "AutoModelForSeq2SeqLM", "img": "AutoModelForImageClassification"}[task]
    model = getattr(transformers, auto).from_config(config)
    if task == "img":
        size = getattr(config, "image_size", 64)
        size = size if isinstance(size, int) else size[0]
        call = dict(pixel_values=torch.randn(2, 3, size, size, generator=generator), labels=torch.tensor([0, 1]))
    else:
        labels = {"clm": ids, "mlm": ids, "cls": torch.tensor([0, 1]), "s2s": ids[:, :16].contiguous()}[task]
        call = dict(input_ids=ids, labels=labels)
        if padded:  # the second sequence padded after 24 tokens, as a batch of unequal texts is
            call["attention_mask"] = torch.ones_like(ids)
            call["attention_mask"][1, 24:] = 0
    return model.train(), {"example_kwargs": call}


def run_one(kind: str, name: str, fraction: float) -> dict[str, Any]:
    """One model's row (in this process)."""
    import recompute_graph as rg
    torch.set_num_threads(1)
    row: dict[str, Any] = {"model": name}
    started = time.perf_counter()
    caught: list[Any] = []
    try:
        model, call = {"timm": _timm_model, "torchvision": _torchvision_model, "hf": _hf_model}[kind](name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                report = rg.verify(model, fraction, **call)
            except rg.InfeasibleBudgetError as error:
                row["floor"] = True
                report = rg.verify(model, error.min_budget_bytes, **call)
        row.update(solver=report.solver, gradient_error=report.gradient_error, budget=report.budget_bytes,
                   predicted=report.predicted_peak_bytes, measured=report.measured_peak_bytes)
    except Exception as error:  # noqa: BLE001 - a row per model, whatever happens
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    row["fallback"] = sorted({str(w.message)[:200] for w in caught if "Fallback" in w.category.__name__})
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def _cell(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"| {row['model']} | | | | | {row['error']} |"
    ratio = row["measured"] / row["predicted"]
    within = "yes" if row["measured"] <= row["budget"] else "**no**"
    path = "executor" if row["fallback"] else "compiler"
    floor = " (floor)" if row.get("floor") else ""
    return (f"| {row['model']} | {path} | {row['solver']}{floor} | {row['gradient_error']:.1e} | {ratio:.3f} | "
            f"{within}{'; ' + row['fallback'][0] if row['fallback'] else ''} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timm", nargs="*", default=[])
    parser.add_argument("--torchvision", nargs="*", default=[])
    parser.add_argument("--hf", nargs="*", default=[])
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--timeout", type=int, default=400)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (kind, name): run in this process
    args = parser.parse_args()
    if args.one:
        print("ROW " + json.dumps(run_one(*args.one, args.fraction)))
        return
    print("| model | path | solver | gradient error | measured / predicted | within the budget |")
    print("|---|---|---|---|---|---|")
    for kind, names in (("timm", args.timm), ("torchvision", args.torchvision), ("hf", args.hf)):
        for name in names:
            command = [sys.executable, __file__, "--one", kind, name, "--fraction", str(args.fraction)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
                row = json.loads(lines[-1][4:]) if lines else {"model": name, "error": done.stderr.strip()[-200:]}
            except subprocess.TimeoutExpired:
                row = {"model": name, "error": f"over {args.timeout} s"}
            print(_cell(row), flush=True)


if __name__ == "__main__":
    main()
