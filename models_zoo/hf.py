"""Hugging Face ``transformers`` models built from a config (no downloads), with a training batch.

Each factory returns ``(model, batch)``, where ``batch`` is the keyword call ``model(**batch)`` that
training makes (``input_ids``, ``attention_mask``, ``labels``; the last sequence is half padding). They
are ``package.module:factory`` models for the command line (``recompute-graph plan
models_zoo.hf:gpt2 --size layers=6``). ``transformers`` is imported when a factory runs, so the zoo
does not depend on it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["gpt2", "bert", "llama", "batch_for"]


def _transformers() -> Any:
    from .third_party import import_torchvision
    try:  # transformers imports torchvision when installed; see third_party.import_torchvision
        import_torchvision()
    except ImportError:
        pass
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def batch_for(vocabulary: int, batch: int, seq_len: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random token ids (labels = inputs) and an attention mask with the last sequence half padded."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocabulary, (batch, seq_len), generator=generator)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[-1, seq_len // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def gpt2(layers: int = 2, width: int = 64, seq_len: int = 32, batch: int = 2, vocabulary: int = 97,
         **config: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``GPT2LMHeadModel``; ``config`` overrides ``GPT2Config`` fields (``resid_pdrop=0.5``)."""
    hf = _transformers()
    model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 16),
                                             n_positions=max(seq_len, 64), vocab_size=vocabulary,
                                             bos_token_id=0, eos_token_id=0, **config))
    return model, batch_for(vocabulary, batch, seq_len)


def bert(layers: int = 2, width: int = 64, seq_len: int = 32, batch: int = 2, vocabulary: int = 97,
         **config: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``BertForMaskedLM``; ``config`` overrides ``BertConfig`` fields."""
    hf = _transformers()
    model = hf.BertForMaskedLM(hf.BertConfig(num_hidden_layers=layers, hidden_size=width,
                                             num_attention_heads=max(1, width // 16), intermediate_size=4 * width,
                                             max_position_embeddings=max(seq_len, 64), vocab_size=vocabulary,
                                             **config))
    return model, batch_for(vocabulary, batch, seq_len)


def llama(layers: int = 2, width: int = 64, seq_len: int = 32, batch: int = 2, vocabulary: int = 97,
          **config: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``LlamaForCausalLM`` with grouped-query attention (half as many key/value heads)."""
    hf = _transformers()
    heads = max(2, width // 16)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                               num_attention_heads=heads, num_key_value_heads=heads // 2,
                                               intermediate_size=8 * width // 3,
                                               max_position_embeddings=max(seq_len, 64), vocab_size=vocabulary,
                                               bos_token_id=0, eos_token_id=0, **config))
    return model, batch_for(vocabulary, batch, seq_len)
