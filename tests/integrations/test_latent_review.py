"""Adversarial review of ``mla_pages="latent"`` and ``PoolShape.values_are_keys``: the combinations the other suites
leave out — a ``kv_b_proj`` with a bias, DoRA, micro-batches of different lengths and modes in one engine, offload
with some layers on the device and late copies, packed and padded batches, sparse steps, window layers over one
page of keys and values, the Triton kernels at a latent of 576 — in float64 against full-sequence training (or
against the path already proven exact)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_oomb.engine import ManagedModelMixin, OOMBConfig, OOMBConfigError, OOMBEngine, paged_attention
from lightning_oomb.engine.offload import delaying_transport
from lightning_oomb.integrations.hf import HFChunkModel
from lightning_oomb.integrations.hf.latent import attend_latent
from tests.helpers.attention import dense_attention
from tests.helpers.models import grads_of, max_relative_error, oomb_step
from tests.integrations.test_latent_pages import _assert_exact, _ids, _model, _truth

pytestmark = pytest.mark.usefixtures("one_thread")


def _biased(model):
    """``model`` with every ``kv_b_proj`` a ``Linear`` with a random bias (its weight kept)."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        for layer in model.model.layers:
            old = layer.self_attn.kv_b_proj
            new = nn.Linear(old.in_features, old.out_features, dtype=old.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.normal_()
            layer.self_attn.kv_b_proj = new
    return model


def _lora(**options):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **options)
    model = peft.get_peft_model(_model(), lora).get_base_model()
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name and name.endswith("bias"):
                p.normal_()  # (peft starts it at zero)
    return model


@pytest.mark.parametrize(
    "build",
    [lambda: _biased(_model()), lambda: _lora(target_modules=["kv_b_proj"], lora_bias=True)],
    ids=["linear-bias", "lora-bias"],
)
def test_a_kv_b_proj_with_a_bias_attends_over_latents_exactly(build):
    """A bias on ``kv_b_proj`` (a ``Linear`` with one, LoRA's ``lora_bias``) makes keys and values affine in the
    latent: its value half joins the output, its key half shifts a query's scores alike; the step equals
    full-sequence training (before: the identity mapped carried the bias into every row of the absorbed weight and
    the step was refused as keys not made of the latent)."""
    model, ids = build(), _ids()
    want_loss, want = _truth(model, ids)
    loss, grads, _ = oomb_step(model, ids, chunk=16, page=8, mla_pages="latent")
    _assert_exact(loss, grads, want_loss, want)


def test_a_key_bias_with_shifted_scores_is_refused():
    """Where the scores are not shift-free (a softcap or sink logits) a key bias cannot be left out: refused."""
    module = _biased(_model()).model.layers[0].self_attn
    from lightning_oomb.integrations.hf.latent import LATENTS

    q = torch.zeros(1, 4, 3, 12, dtype=torch.float64)
    LATENTS[id(module)] = torch.zeros(1, 3, 16, dtype=torch.float64)
    try:
        with pytest.raises(OOMBConfigError, match="bias on .*kv_b_proj and a softcap"):
            attend_latent(module, q, q, q[..., :8], lambda q, kv: q, False, shift_free=False)
    finally:
        LATENTS.pop(id(module), None)


def test_dora_and_a_kv_b_proj_trained_whole_attend_over_latents_exactly():
    """DoRA on ``kv_b_proj`` (its per-row norm is of the weight, not of the input: the identity mapped is the same
    map) and ``modules_to_save`` training a copy of it: full-sequence gradients, the copy's included."""
    model, ids = _lora(target_modules=["kv_b_proj", "q_b_proj"], use_dora=True), _ids()
    want_loss, want = _truth(model, ids)
    loss, grads, _ = oomb_step(model, ids, chunk=16, page=8, mla_pages="latent")
    assert any("kv_b_proj.lora_magnitude_vector" in n for n in grads)
    _assert_exact(loss, grads, want_loss, want)
    model, ids = _lora(target_modules=["q_b_proj"], modules_to_save=["kv_b_proj"]), _ids()
    want_loss, want = _truth(model, ids)
    loss, grads, _ = oomb_step(model, ids, chunk=16, page=8, mla_pages="latent")
    assert any("kv_b_proj.modules_to_save" in n for n in grads)
    _assert_exact(loss, grads, want_loss, want)


def test_micro_batches_of_other_lengths_and_modes_switched_in_one_engine_stay_exact():
    """Two accumulated micro-batches of 37 and 53 tokens over latents, then the same engine reconfigured expanded,
    latent, expanded: each step is full-sequence training's and the pool follows the mode."""
    model = _model()
    a, b = _ids(tokens=37, seed=3), _ids(tokens=53, seed=4)
    (loss_a, want_a), (loss_b, want_b) = _truth(model, a), _truth(model, b)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, mla_pages="latent"))
    got_a = engine.loss(a)
    got_a.backward()
    got_b = engine.loss(b)
    got_b.backward()
    _assert_exact(got_a.detach() + got_b.detach(), grads_of(model), loss_a + loss_b,
                  {n: want_a[n] + want_b[n] for n in want_a})  # fmt: skip
    for mode in ("expanded", "latent", "expanded"):
        engine.reconfigure(dataclasses.replace(engine.config, mla_pages=mode))
        model.zero_grad()
        loss = engine.loss(b)
        loss.backward()
        _assert_exact(loss.detach(), grads_of(model), loss_b, want_b)
        assert engine.pool.shape.values_are_keys == (mode == "latent")
        assert engine.pool.shape.kv_heads == (1 if mode == "latent" else 4)


def test_latents_offloaded_beside_device_layers_with_late_copies_are_bitwise_the_same():
    """Some layers' latents on the device (``hbm_budget`` of two of three), the rest in host memory, reused
    attention, layer checkpointing, 3 or 9 staging buffers, no prefetch: exact; copies run at random later moments
    give the same loss and gradients, bit for bit."""
    model, ids = _model(num_hidden_layers=3, first_k_dense_replace=3), _ids(tokens=70)
    want_loss, want = _truth(model, ids)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, mla_pages="latent"))
    engine.loss(ids).backward()
    budget = 2 * engine.pool.stats()["hbm_pool_bytes"] // 3
    for staging in (3, 9):
        config = OOMBConfig(16, 8, mla_pages="latent", offload=True, hbm_budget=budget, staging_buffers=staging,
                            prefetch_depth=0, reuse_attention=2, layer_checkpointing=True)  # fmt: skip
        runs = []
        for seed, chance in ((None, None), (0, 0.0), (1, 0.3)):
            model.zero_grad()
            late = (
                {}
                if seed is None
                else {"transport": functools.partial(delaying_transport, seed=seed, chance=chance)}
            )
            engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=True), config, **late)
            loss = engine.loss(ids)
            loss.backward()
            runs.append((loss.detach(), grads_of(model)))
        if staging == 3:
            assert 0 < engine.pool.stats()["host_layers"] < 3
        _assert_exact(*runs[0], want_loss, want)
        for loss, grads in runs[1:]:
            assert torch.equal(loss, runs[0][0]) and all(torch.equal(grads[n], runs[0][1][n]) for n in grads)


def test_packed_and_padded_rows_over_latents_equal_expanded_and_sparse_selection_agrees_with_the_cpu_path():
    """Documents packed by restarting ``position_ids`` and a right-padded row: latents give the expanded pages'
    step; a sparse budget of 2 pages selects the same pages as the reference (``"cpu"``) path."""
    model, ids = _model(), _ids(tokens=50)
    positions = torch.stack([torch.cat([torch.arange(20), torch.arange(30)]),
                             torch.cat([torch.arange(33), torch.arange(17)])])  # fmt: skip
    mask = torch.ones_like(ids)
    mask[1, 41:] = 0
    results = {}
    for name, options in (("expanded", {}), ("latent", {}), ("torch", dict(page_budget=2)),
                          ("cpu", dict(page_budget=2, attention_backend="cpu"))):  # fmt: skip
        model.zero_grad()
        mode = "expanded" if name == "expanded" else "latent"
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, mla_pages=mode, **options))
        loss = engine.loss(ids, position_ids=positions, attention_mask=mask)
        loss.backward()
        results[name] = loss.detach(), grads_of(model)
    _assert_exact(*results["latent"], *results["expanded"])
    (loss, grads), (cpu_loss, cpu_grads) = results["torch"], results["cpu"]
    assert abs(loss.item() - cpu_loss.item()) <= 1e-12 * cpu_loss.item()
    assert max_relative_error(grads, cpu_grads) <= 1e-10


class _KeysAsValues(ManagedModelMixin, nn.Module):
    """A tiny float64 LM whose attention passes its keys as its values (``values_are_keys``), layer 0 a sliding
    window of 5 keys: the engine's ``ChunkModel`` and, with ``chunk=None``, full-sequence attention."""

    def __init__(self, layers=2, dim=16, heads=4, kv_heads=2, vocab=64):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = nn.Embedding(vocab, dim, dtype=torch.float64)
            self.q = nn.ModuleList(
                nn.Linear(dim, dim, bias=False, dtype=torch.float64) for _ in range(layers)
            )
            self.k = nn.ModuleList(nn.Linear(dim, kv_heads * dim // heads, bias=False, dtype=torch.float64)
                                   for _ in range(layers))  # fmt: skip
            self.o = nn.ModuleList(
                nn.Linear(dim, dim, bias=False, dtype=torch.float64) for _ in range(layers)
            )
            self.head = nn.Linear(dim, vocab, bias=False, dtype=torch.float64)
        self.heads, self.num_layers, self.kv_heads, self.head_dim = heads, layers, kv_heads, dim // heads
        self.vocab_size = self.num_embeddings = vocab
        self.layer_windows = (5,) + (None,) * (layers - 1)
        self.values_are_keys = True

    def hidden_states(self, input_ids, position_ids, chunk=None):
        x = self.embed(input_ids)
        b, n, _ = x.shape
        for layer, (q, k, o) in enumerate(zip(self.q, self.k, self.o)):
            qs = q(x).view(b, n, self.heads, -1).transpose(1, 2)
            ks = torch.tanh(k(x)).view(b, n, self.kv_heads, -1).transpose(1, 2)
            window = self.layer_windows[layer]
            if chunk is None:
                out = dense_attention(
                    qs, ks.repeat_interleave(2, 1), ks.repeat_interleave(2, 1), 0, 0.5, window
                )
            else:
                out = paged_attention(qs, ks, ks, chunk, layer, 0.5, window)
            x = x + o(out.transpose(1, 2).reshape(b, n, -1))
        return x

    def lm_head(self):
        from lightning_oomb.engine import LMHead

        return LMHead(self.head.weight)


@pytest.mark.parametrize(
    "options", [{}, dict(offload=True, hbm_budget=0, staging_buffers=3)], ids=["device", "hosted-tails"]
)
def test_keys_serving_as_values_with_a_window_layer_keep_one_tail_and_stay_exact(options):
    """One page tensor (and one gradient page) per page for keys serving as values, beside a window layer whose
    tail pages the pool keeps (on the device, or in host memory): full-sequence loss and gradients."""
    model, ids = _KeysAsValues(), _ids(tokens=60, seed=9)
    model.zero_grad()
    logits = model.head(model.hidden_states(ids, torch.arange(60)[None]))[:, :-1]
    want_loss = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    engine = OOMBEngine(model, OOMBConfig(16, 8, **options))
    loss = engine.loss(ids)
    loss.backward()
    shape = engine.pool.shape
    assert shape.values_are_keys and shape.tails[0] is not None
    assert not options or shape.hosted_tails == (0,)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10


def test_the_triton_kernels_over_576_wide_latents_with_packed_documents_and_a_sparse_budget():
    """DeepSeek-V3's latent width (512 + 64: stored at 576, tiled wider) through the interpreted Triton kernels,
    with two packed documents and a page budget of 2: the torch backend's step."""
    from tests.helpers.models import assert_triton_matches_torch

    model = _model(dtype=torch.float32, kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64, num_hidden_layers=1,
                   first_k_dense_replace=1)  # fmt: skip
    positions = torch.cat([torch.arange(20), torch.arange(28)])[None]
    options = {"mla_pages": "latent", "page_budget": 2}
    assert_triton_matches_torch(model, _ids(rows=1, tokens=48), options=options, position_ids=positions)
