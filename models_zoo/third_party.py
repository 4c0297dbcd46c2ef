"""Model code nobody here wrote: torchvision, timm, Hugging Face ``transformers`` and ``diffusers`` builders at
small sizes.

The conformance suite (``tests/conformance/``, ``scripts/conformance.py``) judges the library on these.
Every entry of :data:`CONFORMANCE_MODELS` is ``name -> (family, factory)``; ``factory()`` returns
``(model, call)`` where ``call`` is a tuple of positional inputs or a dict of keyword arguments (the
call training makes). Sizes are small (batch 2–4, 64²–128² images, width 32–64 transformers) so that a
model traces, prices and trains on two CPU cores in seconds. Weights are random (no downloads); dropout
is left as the builders configure it (``drop_rate`` is raised where a builder has one, so that
recomputation must replay masks).

torchvision's wheels here are CUDA builds: with a CPU torch, ``import torchvision`` fails at its fake-op
registrations (``operator torchvision::nms does not exist``). :func:`import_torchvision` imports it with
``torch.library.register_fake`` skipping ``torchvision::`` names, then restores it; the model builders
need none of those C ops.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["import_torchvision", "import_timm", "CONFORMANCE_MODELS", "SECOND_SET", "FAST_SUBSET", "build",
           "available"]

Call = Any  # tuple of positional inputs, or dict of keyword arguments


@functools.lru_cache(maxsize=None)
def import_torchvision() -> Any:
    """``torchvision``, imported so that its missing C ops do not stop the import (module docstring)."""
    original = torch.library.register_fake

    def register_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(op, str) and op.startswith("torchvision::"):
            return (lambda fn: fn) if not args else args[0]
        return original(op, *args, **kwargs)
    torch.library.register_fake = register_fake
    try:
        return importlib.import_module("torchvision")
    finally:
        torch.library.register_fake = original


@functools.lru_cache(maxsize=None)
def import_timm() -> Any:
    """``timm`` (which imports torchvision for a few helpers: see :func:`import_torchvision`)."""
    import_torchvision()
    return importlib.import_module("timm")


def _images(batch: int, size: int, channels: int = 3, seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(seed)),)


def _torchvision(builder: str, size: int = 96, batch: int = 4, **kwargs: Any) -> Callable[[], tuple[nn.Module, Call]]:
    def factory() -> tuple[nn.Module, Call]:
        models = import_torchvision().models
        torch.manual_seed(0)
        return getattr(models, builder)(weights=None, num_classes=10, **kwargs), _images(batch, size)
    return factory


def _torchvision_class(cls: str, size: int = 64, batch: int = 4, **kwargs: Any
                       ) -> Callable[[], tuple[nn.Module, Call]]:
    """A torchvision model class built with small sizes (its builders fix ViT-B's 86 M parameters)."""
    def factory() -> tuple[nn.Module, Call]:
        models = import_torchvision().models
        torch.manual_seed(0)
        return getattr(models, cls)(num_classes=10, **kwargs), _images(batch, size)
    return factory


def _timm(name: str, size: int = 96, batch: int = 4, **kwargs: Any) -> Callable[[], tuple[nn.Module, Call]]:
    def factory() -> tuple[nn.Module, Call]:
        timm = import_timm()
        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs), _images(batch, size)
    return factory


def _timm_class(module: str, cls: str, size: int = 64, batch: int = 4, **kwargs: Any
                ) -> Callable[[], tuple[nn.Module, Call]]:
    """A timm model class built with small sizes (where a registered name fixes the depth and width)."""
    def factory() -> tuple[nn.Module, Call]:
        import_timm()
        torch.manual_seed(0)
        return getattr(importlib.import_module(module), cls)(num_classes=10, **kwargs), _images(batch, size)
    return factory


def _token_batch(vocabulary: int, batch: int = 2, seq_len: int = 16, labels: bool = True) -> dict:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocabulary, (batch, seq_len), generator=generator)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[-1, seq_len // 2:] = 0
    call = {"input_ids": ids, "attention_mask": mask}
    if labels:
        call["labels"] = ids.clone()
    return call


def _hf(config_name: str, model_name: str, call: Callable[[Any], dict], **config: Any
        ) -> Callable[[], tuple[nn.Module, Call]]:
    def factory() -> tuple[nn.Module, Call]:
        try:  # transformers imports torchvision when it is installed (module docstring)
            import_torchvision()
        except ImportError:
            pass
        import transformers
        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        cfg = getattr(transformers, config_name)(**config)
        model = getattr(transformers, model_name)(cfg)
        return model, call(cfg)
    return factory


def _import_diffusers() -> Any:
    try:  # diffusers imports transformers, which imports torchvision when it is installed (module docstring)
        import_torchvision()
    except ImportError:
        pass
    return importlib.import_module("diffusers")


def _diffusers(model_name: str, call: Callable[[], dict], **config: Any) -> Callable[[], tuple[nn.Module, Call]]:
    """A ``diffusers`` model class at a small size, called as a denoising (or autoencoding) step calls it."""
    def factory() -> tuple[nn.Module, Call]:
        diffusers = _import_diffusers()
        torch.manual_seed(0)
        return getattr(diffusers, model_name)(**config), call()
    return factory


def _noisy_latents(batch: int = 2, channels: int = 4, size: int = 16, context: int = 0, classes: bool = False,
                   latents: str = "sample") -> Callable[[], dict]:
    def call() -> dict:
        generator = torch.Generator().manual_seed(5)
        inputs = {latents: torch.randn(batch, channels, size, size, generator=generator),
                  "timestep": torch.randint(0, 1000, (batch,), generator=generator)}
        if context:
            inputs["encoder_hidden_states"] = torch.randn(batch, 7, context, generator=generator)
        if classes:
            inputs["class_labels"] = torch.randint(0, 1000, (batch,), generator=generator)
        return inputs
    return call


def _text(cfg: Any) -> dict:
    return _token_batch(cfg.vocab_size)


def _seq2seq(cfg: Any) -> dict:
    call = _token_batch(cfg.vocab_size)
    call["labels"] = call["labels"][:, :8].contiguous()
    return call


def _vision_hf(cfg: Any) -> dict:
    return {"pixel_values": _images(2, cfg.image_size)[0], "labels": torch.tensor([1, 3])}


def _vision_hf_32(cfg: Any) -> dict:
    return {"pixel_values": _images(2, 32)[0], "labels": torch.tensor([1, 3])}


def _speech_seq2seq(cfg: Any) -> dict:
    generator = torch.Generator().manual_seed(3)
    return {"input_features": torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=generator),
            "labels": torch.randint(2, cfg.vocab_size, (2, 8), generator=generator)}


def _torchvision_video(builder: str, frames: int = 8, size: int = 32) -> Callable[[], tuple[nn.Module, Call]]:
    def factory() -> tuple[nn.Module, Call]:
        models = import_torchvision().models.video
        torch.manual_seed(0)
        clip = torch.randn(2, 3, frames, size, size, generator=torch.Generator().manual_seed(0))
        return getattr(models, builder)(weights=None, num_classes=10), (clip,)
    return factory


def _text_and_images(cfg: Any) -> dict:
    generator = torch.Generator().manual_seed(5)
    return {"input_ids": torch.randint(1, cfg.text_config.vocab_size, (2, 12), generator=generator),
            "pixel_values": _images(2, cfg.vision_config.image_size)[0], "return_loss": True}


def _vision_hf_labels(cfg: Any) -> dict:
    return {"pixel_values": _images(2, cfg.image_size)[0], "labels": torch.tensor([1, 3])}


def _segmentation_hf(cfg: Any) -> dict:
    return {"pixel_values": _images(2, 64)[0],
            "labels": torch.randint(0, cfg.num_labels, (2, 64, 64), generator=torch.Generator().manual_seed(1))}


def _torchvision_segmentation(builder: str, size: int = 64, **kwargs: Any) -> Callable[[], tuple[nn.Module, Call]]:
    def factory() -> tuple[nn.Module, Call]:
        models = import_torchvision().models.segmentation
        torch.manual_seed(0)
        return (getattr(models, builder)(weights=None, weights_backbone=None, num_classes=10, **kwargs),
                _images(2, size))
    return factory


def _audio_hf(cfg: Any) -> dict:
    return {"input_values": torch.randn(2, 1600, generator=torch.Generator().manual_seed(3))}


_ENCODER = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64)

_DECODER = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)

#: name -> (family, factory). Families: torchvision, timm, transformers.
CONFORMANCE_MODELS: dict[str, tuple[str, Callable[[], tuple[nn.Module, Call]]]] = {
    # torchvision classification builders (small inputs)
    **{f"tv_{b}": ("torchvision", _torchvision(b)) for b in (
        "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2", "mobilenet_v3_small",
        "mobilenet_v3_large", "mnasnet0_5", "shufflenet_v2_x0_5", "squeezenet1_1", "densenet121",
        "efficientnet_b0", "efficientnet_v2_s", "regnet_x_400mf", "regnet_y_400mf", "googlenet",
        "convnext_tiny", "alexnet", "vgg11_bn")},
    "tv_googlenet": ("torchvision", _torchvision("googlenet", aux_logits=False, init_weights=True)),
    "tv_alexnet": ("torchvision", _torchvision("alexnet", size=96)),
    "tv_inception_v3": ("torchvision", _torchvision("inception_v3", size=96, aux_logits=False, init_weights=True)),
    "tv_vit": ("torchvision", _torchvision_class("VisionTransformer", image_size=64, patch_size=8, num_layers=2,
                                                num_heads=4, hidden_dim=64, mlp_dim=128, dropout=0.1)),
    "tv_swin_t": ("torchvision", _torchvision("swin_t", size=64)),
    "tv_maxvit": ("torchvision", _torchvision_class("MaxVit", input_size=(64, 64), stem_channels=16, partition_size=2,
                                                   block_channels=[16, 32], block_layers=[1, 1], head_dim=8,
                                                   stochastic_depth_prob=0.0)),
    # timm, across families
    "timm_vit_tiny": ("timm", _timm("vit_tiny_patch16_224", size=64, img_size=64, patch_size=8, depth=4,
                                    drop_rate=0.1)),
    "timm_deit_tiny": ("timm", _timm("deit_tiny_patch16_224", size=64, img_size=64, patch_size=8, depth=4,
                                     drop_rate=0.1)),
    "timm_convnext_atto": ("timm", _timm("convnext_atto", drop_rate=0.1)),
    "timm_efficientnet_b0": ("timm", _timm("efficientnet_b0", drop_rate=0.2)),
    "timm_resnet18d": ("timm", _timm("resnet18d", drop_rate=0.1)),
    "timm_mixer": ("timm", _timm_class("timm.models.mlp_mixer", "MlpMixer", img_size=64, patch_size=8, num_blocks=4,
                                       embed_dim=64, drop_rate=0.1)),
    "timm_swin_tiny": ("timm", _timm("swin_tiny_patch4_window7_224", size=64, img_size=64, window_size=4,
                                     depths=(2, 2, 2, 2), embed_dim=48)),
    "timm_regnetx_002": ("timm", _timm("regnetx_002", drop_rate=0.1)),
    "timm_mobilenetv3_small": ("timm", _timm("mobilenetv3_small_050", drop_rate=0.1)),
    "timm_coatnet_nano": ("timm", _timm("coatnet_nano_rw_224", size=64, img_size=64)),
    "timm_levit_128s": ("timm", _timm("levit_128s", size=64, img_size=64)),
    "timm_ghostnet": ("timm", _timm("ghostnet_050", drop_rate=0.1)),
    "timm_resmlp_12": ("timm", _timm("resmlp_12_224", size=64, img_size=64)),
    # transformers, from configs
    "hf_gpt2": ("transformers", _hf("GPT2Config", "GPT2LMHeadModel", _text, vocab_size=97, n_embd=32,
                                    n_layer=2, n_head=4, n_positions=64)),
    "hf_bert": ("transformers", _hf("BertConfig", "BertForMaskedLM", _text, vocab_size=97, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    max_position_embeddings=64)),
    "hf_llama": ("transformers", _hf("LlamaConfig", "LlamaForCausalLM", _text, **_DECODER)),
    "hf_qwen2": ("transformers", _hf("Qwen2Config", "Qwen2ForCausalLM", _text, **_DECODER)),
    "hf_mistral": ("transformers", _hf("MistralConfig", "MistralForCausalLM", _text, **_DECODER)),
    "hf_t5": ("transformers", _hf("T5Config", "T5ForConditionalGeneration", _seq2seq, vocab_size=97, d_model=32,
                                  d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
                                  pad_token_id=0)),
    "hf_bart": ("transformers", _hf("BartConfig", "BartForConditionalGeneration", _seq2seq, vocab_size=97,
                                    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                    max_position_embeddings=64, pad_token_id=1, decoder_start_token_id=2)),
    "hf_vit": ("transformers", _hf("ViTConfig", "ViTForImageClassification", _vision_hf, image_size=32,
                                   patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, num_labels=10)),
    "hf_wav2vec2": ("transformers", _hf("Wav2Vec2Config", "Wav2Vec2Model", _audio_hf, hidden_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
                                        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                        mask_time_prob=0.0, layerdrop=0.0)),
    # added in session 19, tried as a new user would (docs/results/optimize_conformance.md): shared
    # layers (ALBERT), a mixture of experts (Mixtral), a state-space model (Mamba), speech (Whisper),
    # stochastic depth drawn from a shape (HF Swin), relative position biases (BEiT, DeBERTa), rotary
    # embeddings (EVA-02, GPT-NeoX, Phi), video (R3D), segmentation heads (DeepLabV3, LR-ASPP)
    "hf_distilbert": ("transformers", _hf("DistilBertConfig", "DistilBertForMaskedLM", _text, vocab_size=97, dim=32,
                                          n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)),
    "hf_roberta": ("transformers", _hf("RobertaConfig", "RobertaForMaskedLM", _text, vocab_size=97, hidden_size=32,
                                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                       max_position_embeddings=64)),
    "hf_albert": ("transformers", _hf("AlbertConfig", "AlbertForMaskedLM", _text, vocab_size=97, embedding_size=16,
                                      hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64)),
    "hf_gpt_neox": ("transformers", _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", _text, vocab_size=97, hidden_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                        max_position_embeddings=64)),
    "hf_opt": ("transformers", _hf("OPTConfig", "OPTForCausalLM", _text, vocab_size=97, hidden_size=32,
                                   num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, max_position_embeddings=64,
                                   word_embed_proj_dim=32)),
    "hf_phi": ("transformers", _hf("PhiConfig", "PhiForCausalLM", _text, vocab_size=97, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=64)),
    "hf_gemma": ("transformers", _hf("GemmaConfig", "GemmaForCausalLM", _text, head_dim=8, **_DECODER)),
    "hf_mixtral": ("transformers", _hf("MixtralConfig", "MixtralForCausalLM", _text, num_local_experts=4,
                                       num_experts_per_tok=2, **_DECODER)),
    "hf_deberta_v2": ("transformers", _hf("DebertaV2Config", "DebertaV2ForMaskedLM", _text, vocab_size=97,
                                          hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=64)),
    "hf_mamba": ("transformers", _hf("MambaConfig", "MambaForCausalLM", _text, vocab_size=97, hidden_size=32,
                                     num_hidden_layers=2, state_size=8)),
    "hf_whisper": ("transformers", _hf("WhisperConfig", "WhisperForConditionalGeneration", _speech_seq2seq,
                                       vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
                                       max_target_positions=32, pad_token_id=0, decoder_start_token_id=1)),
    "hf_convnext": ("transformers", _hf("ConvNextConfig", "ConvNextForImageClassification", _vision_hf_32,
                                        hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10,
                                        drop_path_rate=0.1)),
    "hf_swin": ("transformers", _hf("SwinConfig", "SwinForImageClassification", _vision_hf, image_size=32,
                                    patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                                    num_labels=10)),
    "timm_beit": ("timm", _timm("beit_base_patch16_224", size=64, img_size=64, patch_size=8, depth=2, embed_dim=64,
                                num_heads=4)),
    "timm_eva02": ("timm", _timm("eva02_tiny_patch14_224", size=56, img_size=56, depth=2)),
    **{f"timm_{short}": ("timm", _timm(builder, size=64)) for short, builder in (
        ("nf_regnet", "nf_regnet_b0"), ("poolformer", "poolformer_s12"), ("mobilevit", "mobilevit_xxs"),
        ("dla", "dla34"), ("repvgg", "repvgg_a0"), ("hrnet", "hrnet_w18_small"))},
    "timm_xcit": ("timm", _timm("xcit_nano_12_p8_224", size=64, img_size=64)),
    "tv_r3d_18": ("torchvision", _torchvision_video("r3d_18")),
    "tv_lraspp": ("torchvision", _torchvision_segmentation("lraspp_mobilenet_v3_large")),
    "tv_deeplabv3_mnv3": ("torchvision", _torchvision_segmentation("deeplabv3_mobilenet_v3_large", aux_loss=False)),
    # and a third group: ALiBi (BLOOM), multi-query attention (Falcon), recurrences written in Python
    # (RWKV, timm's Sequencer LSTMs), Fourier mixing (FNet), two-tower contrastive loss (CLIP), pooled
    # sequences (Funnel). Tried and left out: RAFT (after one eager step its correlation block holds a
    # non-leaf tensor, and the check's deep copy of the model fails), S3D (needs 224² clips), CrossViT
    # (its two branches' patch grids must match its image size)
    "hf_clip": ("transformers", _hf("CLIPConfig", "CLIPModel", _text_and_images, projection_dim=16,
                                    text_config=dict(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=64,
                                                     max_position_embeddings=16),
                                    vision_config=dict(image_size=32, patch_size=8, hidden_size=32,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       intermediate_size=64))),
    "hf_bloom": ("transformers", _hf("BloomConfig", "BloomForCausalLM", _text, vocab_size=97, hidden_size=32,
                                     n_layer=2, n_head=4)),
    "hf_falcon": ("transformers", _hf("FalconConfig", "FalconForCausalLM", _text, vocab_size=97, hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=4)),
    "hf_gptj": ("transformers", _hf("GPTJConfig", "GPTJForCausalLM", _text, vocab_size=97, n_embd=32, n_layer=2,
                                    n_head=4, rotary_dim=4, n_positions=64)),
    "hf_codegen": ("transformers", _hf("CodeGenConfig", "CodeGenForCausalLM", _text, vocab_size=97, n_embd=32,
                                       n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64)),
    "hf_qwen3": ("transformers", _hf("Qwen3Config", "Qwen3ForCausalLM", _text, head_dim=8, **_DECODER)),
    "hf_qwen3_moe": ("transformers", _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _text, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, **_DECODER)),
    "hf_modernbert": ("transformers", _hf("ModernBertConfig", "ModernBertForMaskedLM", _text, vocab_size=97,
                                          hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=64, pad_token_id=0)),
    "hf_dinov2": ("transformers", _hf("Dinov2Config", "Dinov2ForImageClassification", _vision_hf_labels,
                                      image_size=28, patch_size=7, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, mlp_ratio=2, num_labels=10, drop_path_rate=0.1)),
    "hf_segformer": ("transformers", _hf("SegformerConfig", "SegformerForSemanticSegmentation", _segmentation_hf,
                                         num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                         num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=10,
                                         strides=[4, 2], patch_sizes=[7, 3], mlp_ratios=[2, 2])),
    "hf_hubert": ("transformers", _hf("HubertConfig", "HubertModel", _audio_hf, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
                                      conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0)),
    "hf_pegasus": ("transformers", _hf("PegasusConfig", "PegasusForConditionalGeneration", _seq2seq, vocab_size=97,
                                       d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                       max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=0)),
    "hf_electra": ("transformers", _hf("ElectraConfig", "ElectraForMaskedLM", _text, embedding_size=16,
                                       **_ENCODER)),
    "hf_mobilebert": ("transformers", _hf("MobileBertConfig", "MobileBertForMaskedLM", _text, vocab_size=97,
                                          hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, embedding_size=16, intra_bottleneck_size=16,
                                          true_hidden_size=16, max_position_embeddings=64,
                                          num_feedforward_networks=2)),
    "hf_fnet": ("transformers", _hf("FNetConfig", "FNetForMaskedLM", _text, vocab_size=97, hidden_size=32,
                                    num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64)),
    "hf_rwkv": ("transformers", _hf("RwkvConfig", "RwkvForCausalLM", _text, vocab_size=97, hidden_size=32,
                                    num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
                                    context_length=64)),
    "hf_xlnet": ("transformers", _hf("XLNetConfig", "XLNetLMHeadModel", _text, vocab_size=97, d_model=32, n_layer=2,
                                     n_head=4, d_inner=64)),
    "hf_convbert": ("transformers", _hf("ConvBertConfig", "ConvBertForMaskedLM", _text, embedding_size=32,
                                        **_ENCODER)),
    "hf_funnel": ("transformers", _hf("FunnelConfig", "FunnelForMaskedLM", _text, vocab_size=97, d_model=32, n_head=4,
                                      d_head=8, d_inner=64, block_sizes=[1, 1], num_decoder_layers=1)),
    "hf_bigbird": ("transformers", _hf("BigBirdConfig", "BigBirdForMaskedLM", _text, attention_type="original_full",
                                       **_ENCODER)),
    "timm_cait": ("timm", _timm("cait_xxs24_224", size=64, img_size=64, patch_size=8, depth=2)),
    "timm_sequencer": ("timm", _timm("sequencer2d_s", size=64, layers=[1, 1, 1, 1])),
    "timm_gcvit": ("timm", _timm("gcvit_xxtiny", size=64, img_size=64)),
    **{f"timm_{short}": ("timm", _timm(builder, size=64)) for short, builder in (
        ("pvt_v2", "pvt_v2_b0"), ("efficientvit", "efficientvit_m0"), ("fastvit", "fastvit_t8"),
        ("edgenext", "edgenext_xx_small"), ("mobileone", "mobileone_s0"), ("rexnet", "rexnet_100"))},
    "timm_gmlp": ("timm", _timm("gmlp_ti16_224", size=64, img_size=64)),
    "tv_swin_v2_t": ("torchvision", _torchvision("swin_v2_t", size=64)),
    # diffusers (session 42): Stable Diffusion's UNet and VAE, and DiT, at small sizes
    "diffusers_unet2d_cond": ("diffusers", _diffusers(
        "UNet2DConditionModel", _noisy_latents(context=32), sample_size=16, in_channels=4, out_channels=4,
        layers_per_block=1, block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
        norm_num_groups=8)),
    "diffusers_vae": ("diffusers", _diffusers(
        "AutoencoderKL", lambda: {"sample": _images(2, 32)[0], "sample_posterior": True}, in_channels=3,
        out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8, sample_size=32)),
    "diffusers_dit": ("diffusers", _diffusers(
        "DiTTransformer2DModel", _noisy_latents(batch=8, classes=True, latents="hidden_states"),
        num_attention_heads=2, attention_head_dim=16,
        in_channels=4, out_channels=4, num_layers=3, sample_size=16, patch_size=2, num_embeds_ada_norm=1000,
        dropout=0.1)),
}

#: The models added after the first 45 (session 19); the sweep reports them apart (``--second-set``).
SECOND_SET = tuple(list(CONFORMANCE_MODELS)[45:])

#: The CI subset: one or two per family, chosen for the patterns that broke before (ViT shape reads,
#: EfficientNet in-place dropout on a view, T5's writes through views) and for speed.
FAST_SUBSET = ("tv_resnet18", "tv_efficientnet_b0", "tv_vit", "timm_vit_tiny", "timm_convnext_atto",
               "hf_gpt2", "hf_t5")


def available(name: str) -> bool:
    """Whether the family package of ``name`` can be imported here."""
    family = CONFORMANCE_MODELS[name][0]
    try:
        {"torchvision": import_torchvision, "timm": import_timm,
         "transformers": lambda: importlib.import_module("transformers"),
         "diffusers": _import_diffusers}[family]()
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def build(name: str) -> tuple[nn.Module, Call]:
    """``(model, call)`` for conformance model ``name`` in training mode."""
    if name not in CONFORMANCE_MODELS:
        raise KeyError(f"unknown conformance model {name!r}; known: {', '.join(sorted(CONFORMANCE_MODELS))}")
    model, call = CONFORMANCE_MODELS[name][1]()
    return model.train(), call
