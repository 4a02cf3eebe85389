"""Breadth: ``fit(model, x, budget="min")`` then ``verify`` on many architectures.

Hugging Face models of every family (decoder-only with grouped-query attention, mixtures of
experts, encoder-only, encoder-decoder, vision) and MONAI 3D networks, each built from a tiny
config in code (no download: ``HF_HUB_OFFLINE=1``). Every planned step must pass every check of
``verify``: gradients, outputs, buffers and RNG bitwise equal to the plain step, and the
measured peak within tolerance of the prediction and the budget.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memfit

VOCAB, BATCH, SEQ = 64, 2, 16
# Small enough for the whole file to run in well under two minutes on one core.
TINY_LM = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64)


def _ids(seed: int = 0, n: int = SEQ) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, n), generator=torch.Generator().manual_seed(seed))


def _lm(x: torch.Tensor) -> dict[str, Any]:
    return {"input_ids": x, "labels": x}


def _image(c: int = 3, size: int = 32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(BATCH, c, size, size, generator=g),
            "labels": torch.randint(0, 10, (BATCH,), generator=g)}


def _hf(cls: str, cfg: str, inputs: Callable[[], Any], **kw: Any) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        model = getattr(transformers, cls)(getattr(transformers, cfg)(**kw))
        return model.train(), inputs()
    return build


# ``use_cache=False``: causal LMs would otherwise build a KV cache in a training step.
CAUSAL = dict(TINY_LM, use_cache=False)
ENC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=64)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False)


def _seq2seq() -> dict[str, Any]:
    return {"input_ids": _ids(0), "labels": _ids(1, SEQ // 2)}


HF: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    # decoder-only, grouped-query attention
    "llama": _hf("LlamaForCausalLM", "LlamaConfig", lambda: _lm(_ids()), num_key_value_heads=2, **CAUSAL),
    "qwen2": _hf("Qwen2ForCausalLM", "Qwen2Config", lambda: _lm(_ids()), num_key_value_heads=2, **CAUSAL),
    "mistral": _hf("MistralForCausalLM", "MistralConfig", lambda: _lm(_ids()), num_key_value_heads=2,
                   **CAUSAL),
    "gemma": _hf("GemmaForCausalLM", "GemmaConfig", lambda: _lm(_ids()), num_key_value_heads=2,
                 head_dim=8, **CAUSAL),
    "phi3": _hf("Phi3ForCausalLM", "Phi3Config", lambda: _lm(_ids()), num_key_value_heads=2,
                pad_token_id=0, **CAUSAL),
    # mixtures of experts
    "mixtral": _hf("MixtralForCausalLM", "MixtralConfig", lambda: _lm(_ids()), num_key_value_heads=2,
                   num_local_experts=4, num_experts_per_tok=2, **CAUSAL),
    "qwen2_moe": _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", lambda: _lm(_ids()),
                     num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=32, **CAUSAL),
    # decoder-only, multi-head attention
    "gpt2": _hf("GPT2LMHeadModel", "GPT2Config", lambda: _lm(_ids()), vocab_size=VOCAB, n_embd=32,
                n_layer=2, n_head=4, n_positions=64, use_cache=False),
    "gpt_neox": _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", lambda: _lm(_ids()), **CAUSAL),
    "opt": _hf("OPTForCausalLM", "OPTConfig", lambda: _lm(_ids()), vocab_size=VOCAB, hidden_size=32,
               ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
               max_position_embeddings=64, use_cache=False),
    # encoder-only
    "bert": _hf("BertForMaskedLM", "BertConfig", lambda: _lm(_ids()), **ENC),
    "roberta": _hf("RobertaForMaskedLM", "RobertaConfig", lambda: _lm(_ids()),
                   **dict(ENC, max_position_embeddings=66)),
    "distilbert": _hf("DistilBertForMaskedLM", "DistilBertConfig", lambda: _lm(_ids()), vocab_size=VOCAB,
                      dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64),
    "electra": _hf("ElectraForMaskedLM", "ElectraConfig", lambda: _lm(_ids()), embedding_size=16, **ENC),
    # encoder-decoder
    "t5": _hf("T5ForConditionalGeneration", "T5Config", _seq2seq, vocab_size=VOCAB, d_model=32, d_kv=8,
              d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4, decoder_start_token_id=0,
              pad_token_id=0, use_cache=False),
    "bart": _hf("BartForConditionalGeneration", "BartConfig", _seq2seq, **SEQ2SEQ),
    # vision
    "vit": _hf("ViTForImageClassification", "ViTConfig", _image, image_size=32, patch_size=8,
               hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               num_labels=10),
    "convnext": _hf("ConvNextForImageClassification", "ConvNextConfig", _image, hidden_sizes=[8, 16],
                    depths=[1, 1], num_stages=2, out_features=None, num_labels=10),
    "resnet": _hf("ResNetForImageClassification", "ResNetConfig", _image, embedding_size=8,
                  hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10),
    "swin": _hf("SwinForImageClassification", "SwinConfig", _image, image_size=32, patch_size=4,
                embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=10),
}


def _volume(size: int) -> torch.Tensor:
    # two samples: BatchNorm in training needs more than one value per channel at 1x1x1
    return torch.randn(2, 1, size, size, size, generator=torch.Generator().manual_seed(0))


def _monai(name: str, size: int, **kw: Any) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        nets = pytest.importorskip("monai.networks.nets")
        torch.manual_seed(0)
        return getattr(nets, name)(**kw).train(), _volume(size)
    return build


MONAI: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "monai_unet": _monai("UNet", 16, spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16),
                         strides=(2, 2), num_res_units=1),
    "monai_basicunet": _monai("BasicUNet", 16, spatial_dims=3, in_channels=1, out_channels=2,
                              features=(4, 4, 8, 8, 16, 4), norm="batch"),
    "monai_segresnet": _monai("SegResNet", 16, spatial_dims=3, init_filters=8, in_channels=1,
                              out_channels=2, blocks_down=(1, 2), blocks_up=(1,)),
    "monai_unetr": _monai("UNETR", 16, in_channels=1, out_channels=2, img_size=(16, 16, 16),
                          feature_size=4, hidden_size=32, mlp_dim=64, num_heads=4),
    "monai_swinunetr": _monai("SwinUNETR", 32, in_channels=1, out_channels=2, feature_size=12,
                              depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), norm_name="batch"),
    "monai_densenet121": _monai("DenseNet121", 32, spatial_dims=3, in_channels=1, out_channels=2,
                                init_features=8, growth_rate=4, block_config=(2, 2, 2, 2)),
    "monai_attentionunet": _monai("AttentionUnet", 16, spatial_dims=3, in_channels=1, out_channels=2,
                                  channels=(4, 8, 16), strides=(2, 2)),
}

CASES = {**HF, **MONAI}


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc():
    """Keep the objects of the imported libraries out of the collector's sight.

    ``measure`` collects garbage before each metered run; with transformers and MONAI imported
    a full collection walks their millions of objects (0.6-0.8 s each here, 4 per case). Frozen
    objects are skipped, garbage made by the steps is still collected.
    """
    pytest.importorskip("transformers")
    pytest.importorskip("monai.networks.nets")
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(CASES), ids=list(CASES))
def test_fit_min_then_verify(arch):
    model, x = CASES[arch]()
    memfit.fit(model, x, budget="min")
    plan = model.memfit_plan
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    report = memfit.verify(model, x)
    assert report.bitwise and report.max_abs_diff == 0.0, str(report)
    assert report.ok, str(report)
