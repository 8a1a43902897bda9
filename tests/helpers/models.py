"""Tiny Hugging Face causal LMs built from config classes (no downloads) and the full-sequence oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FAMILIES = ("qwen2", "llama", "mistral", "qwen3")


def build_causal_lm(family: str = "qwen2", dtype=torch.float64, seed: int = 0, **overrides):
    """A 2-layer model with GQA ratio 7 (7 query heads per KV head, like Qwen2.5-7B's 28:4)."""
    import transformers as tf

    config_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    kwargs = dict(
        hidden_size=56,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=7,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=97,
        initializer_range=0.2,  # attention far from uniform, so position errors show
        attn_implementation="sdpa",
    )
    if family == "mistral":
        kwargs["sliding_window"] = 11  # active: shorter than every test sequence
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).to(dtype)


def full_sequence_loss(model, input_ids, labels=None):
    """Plain full-sequence training loss in the model's dtype (HF's own loss upcasts to fp32 only)."""
    labels = input_ids if labels is None else labels
    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state
    logits = model.get_output_embeddings()(hidden)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_relative_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)).item() for n in want)
