"""Tiny transformers models with random weights (no downloads) and their example inputs, for tests and
benchmarks. Each entry builds (model, example_inputs, example_kwargs); the model returns `.loss`."""
from __future__ import annotations

from typing import Any, Callable

import torch


def _ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def llama(batch=4, seq=32, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                attention_dropout=0.0, attn_implementation="sdpa"), **over})
    ids = _ids(batch, seq, cfg.vocab_size)
    return LlamaForCausalLM(cfg), (ids,), {"labels": ids}


def qwen2(batch=4, seq=32, **over):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, tie_word_embeddings=True, attn_implementation="sdpa", **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return Qwen2ForCausalLM(cfg), (ids,), {"labels": ids}


def gpt2(batch=4, seq=32, **over):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return GPT2LMHeadModel(cfg), (ids,), {"labels": ids}


def bert(batch=4, seq=32, **over):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="sdpa", **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return BertForMaskedLM(cfg), (ids,), {"labels": ids}


def t5(batch=4, seq=32, layers=2, **over):
    from transformers import T5Config, T5ForConditionalGeneration

    # The first layer of each stack differs (it holds the relative position bias): with layers >= 3 the others
    # form a repeated stack.
    cfg = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_decoder_layers=layers,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return T5ForConditionalGeneration(cfg), (ids,), {"labels": ids}


def vit(batch=4, **over):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_labels=10, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="sdpa", **over)
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(0))
    return ViTForImageClassification(cfg), (x,), {"labels": labels}


def gpt_neox(batch=4, seq=32, **over):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0,
                        attn_implementation="sdpa", **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return GPTNeoXForCausalLM(cfg), (ids,), {"labels": ids}


def opt(batch=4, seq=32, **over):
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, layerdrop=0.0, attn_implementation="sdpa", **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return OPTForCausalLM(cfg), (ids,), {"labels": ids}


def phi3(batch=4, seq=32, **over):
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, attn_implementation="sdpa", **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return Phi3ForCausalLM(cfg), (ids,), {"labels": ids}


def falcon(batch=4, seq=32, **over):
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_kv_heads=2, new_decoder_architecture=True, attention_dropout=0.0, hidden_dropout=0.0,
                       max_position_embeddings=64, attn_implementation="sdpa", **over)
    ids = _ids(batch, seq, cfg.vocab_size)
    return FalconForCausalLM(cfg), (ids,), {"labels": ids}


def _images(batch: int, channels: int, size: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, channels, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)


def resnet(batch=4, **over):
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(**{**dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                 layer_type="basic", num_labels=10), **over})
    x, labels = _images(batch, 3, 32, cfg.num_labels)
    return ResNetForImageClassification(cfg), (x,), {"labels": labels}


def convnext(batch=4, **over):
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(**{**dict(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                   num_labels=10, drop_path_rate=0.0), **over})
    x, labels = _images(batch, 3, 32, cfg.num_labels)
    return ConvNextForImageClassification(cfg), (x,), {"labels": labels}


def wav2vec2(batch=4, seq=32, **over):
    """Sequence classification over `seq` feature frames (raw audio of 10 * seq + 10 samples). Wav2Vec2ForCTC
    checks `labels.max()` against the vocabulary in Python, which a trace under fake tensors cannot evaluate."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = Wav2Vec2Config(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0, num_labels=5, classifier_proj_size=16,
        attn_implementation="sdpa"), **over})
    g = torch.Generator().manual_seed(0)
    audio = torch.randn(batch, 10 * seq + 10, generator=g)
    labels = torch.randint(0, cfg.num_labels, (batch,), generator=g)
    return Wav2Vec2ForSequenceClassification(cfg), (audio,), {"labels": labels}


def whisper(batch=4, seq=32, **over):
    """`seq` decoder tokens over 64 log-mel frames (the encoder takes exactly 2 * max_source_positions)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(**{**dict(
        vocab_size=128, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=32,
        max_target_positions=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, attn_implementation="sdpa"), **over})
    g = torch.Generator().manual_seed(0)
    features = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
    labels = torch.randint(3, cfg.vocab_size, (batch, seq), generator=g)
    return WhisperForConditionalGeneration(cfg), (features,), {"labels": labels}


MODELS: dict[str, Callable[..., tuple[Any, tuple, dict]]] = {
    "llama": llama, "qwen2": qwen2, "gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit,
    "gpt_neox": gpt_neox, "opt": opt, "phi3": phi3, "falcon": falcon,
    "resnet": resnet, "convnext": convnext, "wav2vec2": wav2vec2, "whisper": whisper,
}
# Builders that take no sequence length (images of a fixed size).
IMAGE_MODELS = frozenset({"vit", "resnet", "convnext"})


def padded(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention_mask, labels) for a batch whose row i holds lengths[i] real tokens, right-padded: the mask is
    0 on the padding and the labels are -100 there (what a data collator for fine-tuning produces)."""
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return mask, labels
