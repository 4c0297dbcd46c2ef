"""Hugging Face ``transformers`` models (built from a config, no downloads) optimized end to end on CPU:
measured peak and step time of store-all, of ``transformers``' own gradient checkpointing (per layer,
``activation_checkpointing_enable()``, non-reentrant), and of our plans at a budget sweep; same inputs, same meter
(the allocator: ``measure.peak_memory``), one run per model.

    python scripts/hf_models.py [--models gpt2 bert llama] [--layers 6] [--width 256] [--seq-len 256]
                                [--batch 4] [--budgets 0.9 0.8 0.75 0.7] [--repeats 5]

Needs ``pip install transformers`` (``recompute-graph[hf]``). Peak: bytes above what is live before the
step, parameter gradients included (they are freed before each step); ratios are to store-all measured
in the same run. Our rows also give the planning time (export, pricing, solving).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Callable

import torch

import recompute_graph as rg
from recompute_graph.measure import peak_memory, time_step


def build(name: str, layers: int, width: int, seq_len: int) -> torch.nn.Module:
    from models_zoo.third_party import import_torchvision
    try:  # transformers imports torchvision when installed (see third_party.import_torchvision)
        import_torchvision()
    except ImportError:
        pass
    import transformers as hf
    hf.logging.set_verbosity_error()
    heads = max(1, width // 64)
    if name == "gpt2":
        config = hf.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=seq_len)
        return hf.GPT2LMHeadModel(config)
    if name == "bert":
        config = hf.BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                               intermediate_size=4 * width, max_position_embeddings=seq_len)
        return hf.BertForMaskedLM(config)
    if name == "llama":
        config = hf.LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                num_key_value_heads=max(1, heads // 2), intermediate_size=8 * width // 3,
                                max_position_embeddings=seq_len, vocab_size=32000)
        return hf.LlamaForCausalLM(config)
    raise SystemExit(f"unknown model {name!r}: gpt2, bert or llama")


def training_step(model: torch.nn.Module, kwargs: dict) -> Callable[[], Any]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        model(**kwargs).loss.backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gpt2", "bert", "llama"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budgets", nargs="*", type=float, default=[0.9, 0.8, 0.75, 0.7])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| model | parameters | run | plan | planning | peak | ratio | step time | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model = build(name, args.layers, args.width, args.seq_len).train()
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        parameters = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M"
        rows: list[tuple[str, str, str, Callable[[], Any]]] = [
            ("store-all (original)", "", "", training_step(model, kwargs))]
        checkpointed = copy.deepcopy(model)
        if hasattr(checkpointed, "activation_checkpointing_enable"):  # transformers >= 5.20
            checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        rows.append(("transformers gradient checkpointing", "every layer", "", training_step(checkpointed, kwargs)))
        for budget in args.budgets:
            start = time.perf_counter()
            try:
                optimized = rg.optimize(model, budget, example_kwargs=kwargs)
            except rg.InfeasibleBudgetError as error:
                rows.append((f"recompute_graph {budget:.0%}", str(error).split(";")[1].strip()[:60], "", None))
                continue
            planning = f"{time.perf_counter() - start:.1f} s"
            plan = optimized.recompute_plan
            rows.append((f"recompute_graph {budget:.0%}",
                         f"{plan.solver}, predicted {rg.format_bytes(plan.predicted_peak_bytes)}", planning,
                         training_step(optimized, kwargs)))
        measured = [row for row in rows if row[3] is not None]
        peaks, seconds = _measure(measured, args.repeats)
        for label, plan_text, planning, step in rows:
            if step is None:
                print(f"| {name} | {parameters} | {label} | {plan_text} | | | | | |", flush=True)
                continue
            peak, time_seconds = peaks[label], seconds[label]
            print(f"| {name} | {parameters} | {label} | {plan_text} | {planning} | {rg.format_bytes(peak)} | "
                  f"{peak / peaks[rows[0][0]]:.2f} | {time_seconds * 1e3:.0f} ms | "
                  f"x{time_seconds / seconds[rows[0][0]]:.2f} |", flush=True)


def _measure(rows: list, repeats: int) -> tuple[dict[str, int], dict[str, float]]:
    """Peak of each row's step, and its median step time over ``repeats`` rounds that run every row
    once in turn (after one warm-up round), so that drifts of the machine hit all rows alike."""
    peaks = {label: peak_memory(step) for label, _, _, step in rows}  # also the warm-up round
    times: dict[str, list[float]] = {label: [] for label, _, _, _ in rows}
    for _ in range(repeats):
        for label, _, _, step in rows:
            times[label].append(time_step(step, repeats=1, warmup=0).median_seconds)
    return peaks, {label: statistics.median(values) for label, values in times.items()}

if __name__ == "__main__":
    main()
