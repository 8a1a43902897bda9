"""The decoder stack of a Hugging Face causal LM: the module whose forward turns token ids into final hidden
states (``last_hidden_state``), which the engine calls chunk by chunk."""

from __future__ import annotations

import torch


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """``model.get_decoder()``, or the inner ``model`` where that is not a decoder stack: Mllama's causal LM returns
    itself, ModernBERT's decoder returns its output projection."""
    decoder = model.get_decoder()
    if decoder is model or not hasattr(decoder, "get_input_embeddings"):
        decoder = getattr(model, "model", decoder)
    return decoder
