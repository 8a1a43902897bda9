"""Adversarial review of the window tails in host memory (``PoolShape.hosted_tails``) and of KV-sharing layers
(``layer_kv_sources``): the combinations the other suites leave out, against full-sequence training in float64
(relative error 1e-10) and the memory planner byte for byte."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.model_shape import layer_kv_sources
from lightning_oomb.engine.offload import delaying_transport
from lightning_oomb.integrations.hf import HFChunkModel
from tests.engine.test_planner import assert_pool_planned
from tests.helpers.models import TINY, exact_full_sequence_loss, grads_of, max_relative_error
from tests.integrations.test_kv_sharing import _model as gemma4_e_like

pytestmark = pytest.mark.usefixtures("one_thread")

HOSTED = {"offload": True, "hbm_budget": 0, "staging_buffers": 2}  # tails and full layers in host memory


def ids_of(seq: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_exact(model, ids, checkpointing=False, seed=0, **options) -> OOMBEngine:
    """One OOMB step (copies run late: only when waited for) equals full-sequence training; the engine."""
    model.zero_grad()
    want_loss = exact_full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    config = OOMBConfig(16, 8, layer_checkpointing=checkpointing, **options)
    transport = functools.partial(delaying_transport, seed=seed, chance=0.0)
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config, transport)
    loss = engine.loss(ids)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10
    return engine


def gemma3n(**overrides):
    """A tiny Gemma 3n text model (AltUp, Laurel, per-layer inputs) of 6 layers (sliding, sliding, full) x 2, window
    8, whose last 3 layers reuse K/V (3 and 4 those of layer 1, 5 those of layer 2); its norms in float64."""
    fields = dict(
        TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_hidden_layers=6, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=3,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 6, intermediate_size=[32] * 6, **overrides,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tf.Gemma3nForCausalLM(tf.Gemma3nTextConfig(**fields)).to(torch.float64)
    for module in model.modules():  # (they compute in float32: exact only so)
        if type(module).__name__ == "Gemma3nRMSNorm":
            module.forward = lambda x, m=module: m._norm(x) * (m.weight if m.with_scale else 1.0)
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gemma3n_sharing_layers_with_hosted_tails_are_exact(checkpointing):
    """Gemma 3n's KV-sharing layers (not covered elsewhere) read their sources' pages, beside a window layer whose
    tails wait in host memory, the copies running late."""
    model = gemma3n()
    assert layer_kv_sources(model.config) == (None, None, None, 1, 1, 2)
    engine = assert_exact(model, ids_of(100, seed=4), checkpointing, **HOSTED)
    assert engine.pool.shape.aliases == (3, 4, 5) and engine.pool.shape.hosted_tails == (0,)


def test_the_plan_of_gemma3n_counts_its_pool():
    """Gemma 3n's config lists a width per layer (``intermediate_size``): the planner added that list to an int
    (``TypeError`` from ``plan``, so the strategies' memory plan failed at setup for every Gemma 3n); it takes the
    widest (``model_shape._mlp_width``). Its pool — sharing layers without pages, a window layer's tails on the
    host — planned byte for byte."""
    model = gemma3n()
    ids = ids_of(100, seed=4)
    assert_pool_planned(model, OOMBConfig(16, 8), ids)
    engine = assert_pool_planned(model, OOMBConfig(16, 8, **HOSTED), ids)
    assert engine.pool.shape.hosted_tails == (0,)


def test_sharing_layers_beside_hosted_tails_and_a_host_tier_layer_are_exact_and_planned():
    """9 layers (sliding, sliding, full) x 3, the last 3 sharing: the sources (4, 5) stay on the device, the other
    window layers' tails (0, 1, 3) go to the host and so does the full layer 2 (a host-tier layer streaming through
    two staging buffers), the sharing layers read the device pages of theirs; reused results on the last 2 chunks."""
    nine = {
        "num_hidden_layers": 9,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 3,
    }
    model = gemma4_e_like(**nine)
    engine = assert_exact(model, ids_of(120, seed=2), seed=1, reuse_attention=2, **HOSTED)
    shape, stats = engine.pool.shape, engine.pool.stats()
    assert shape.aliases == (6, 7, 8) and shape.hosted_tails == (0, 1, 3) and stats["host_layers"] == 1
    assert_pool_planned(model, OOMBConfig(16, 8, **HOSTED), ids_of(120, seed=2))
