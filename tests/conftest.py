"""Shared helpers for the model / objective tests: tiny transformers Qwen2 checkpoints."""

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# Tiny Qwen2 shapes: GQA (4 query heads over 2 kv heads), non-default rope_theta.
TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=2500.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def make_hf_model(seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A random fp32 transformers Qwen2ForCausalLM with O(1)-sized logits.

    transformers initializes with std 0.02 and zero biases, which would make logits (and any
    comparison of them) nearly trivial; every parameter is perturbed so that biases, norm
    weights and the LM head all matter.
    """
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides}))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "embed" in name or "lm_head" in name else 0.15
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def save_hf(path, seed: int = 0, max_shard_size=None, **overrides) -> Qwen2ForCausalLM:
    model = make_hf_model(seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    return model


def hf_logits(model, ids, attention_mask=None, position_ids=None) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long),
            attention_mask=None
            if attention_mask is None
            else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long),
            position_ids=None
            if position_ids is None
            else torch.as_tensor(np.asarray(position_ids), dtype=torch.long),
        )
    return out.logits.float().numpy()


@pytest.fixture(scope="session")
def tied_ckpt(tmp_path_factory):
    """(directory, transformers model) of a tied-embedding tiny Qwen2 checkpoint."""
    path = tmp_path_factory.mktemp("hf_tied")
    return path, save_hf(path, seed=0)


@pytest.fixture(scope="session")
def untied_ckpt(tmp_path_factory):
    """(directory, transformers model): untied LM head, explicit head_dim, another rope_theta."""
    path = tmp_path_factory.mktemp("hf_untied")
    model = save_hf(
        path, seed=3, tie_word_embeddings=False, head_dim=12, rope_theta=1e6, num_hidden_layers=3
    )
    return path, model
