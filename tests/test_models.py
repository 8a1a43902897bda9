"""CausalLMModule: lazy model construction, from_pretrained from a local folder, the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_oomb import OOMBConfigError
from lightning_oomb.models import QWEN2_5_7B, CausalLMModule, build_config, lr_factor, qwen2_5_7b_config

TINY = {
    "model_type": "qwen2",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def test_module_builds_lazily_from_a_config():
    module = CausalLMModule(config=TINY)
    assert module.model is None  # nothing built until the Trainer (or the user) calls configure_model
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model and type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.hidden_size == 16 and model.config._attn_implementation == "sdpa"


def test_module_loads_a_local_checkpoint(tmp_path):
    source = CausalLMModule(config=TINY)
    source.configure_model()
    source.model.save_pretrained(tmp_path)
    module = CausalLMModule(model_name_or_path=str(tmp_path), dtype="float64")
    module.configure_model()
    assert module.model.dtype == torch.float64
    for (name, a), b in zip(source.model.state_dict().items(), module.model.state_dict().values()):
        assert torch.equal(a.double(), b), name


@pytest.mark.parametrize("kwargs", [{}, {"model_name_or_path": "x", "config": TINY}])
def test_module_needs_exactly_one_model_source(kwargs):
    with pytest.raises(OOMBConfigError, match="exactly one of model_name_or_path"):
        CausalLMModule(**kwargs)


def test_config_needs_a_model_type():
    with pytest.raises(OOMBConfigError, match="model_type"):
        build_config({"hidden_size": 8})


def test_qwen2_5_7b_shape():
    config = qwen2_5_7b_config(num_hidden_layers=2)
    assert config.model_type == "qwen2" and config.num_hidden_layers == 2
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (3584, 28, 4)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (128, 18944, 152064)
    assert not config.tie_word_embeddings and config.rms_norm_eps == 1e-6
    assert config.rope_parameters["rope_theta"] == QWEN2_5_7B["rope_theta"] == 1e6


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[20] == pytest.approx(0.1)
    assert lr_factor(100, 0, math.inf, 0.1) == 1.0  # no planned end: constant after the warm-up


def test_weight_decay_skips_norms_and_biases():
    module = CausalLMModule(config=TINY, weight_decay=0.1)
    module.configure_model()
    module.trainer = type("Trainer", (), {"estimated_stepping_batches": 10})()
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
