"""Hooks a user puts on the trained model (``engine/user_hooks.py``): a gradient mask on the LM head's weight (the
embedding's when tied: "train only the new tokens' rows") is exact, in float64 against full-sequence training and
under every 16-bit gradient summing; post-accumulate-grad hooks and NEFTune are refused before any work; other
user hooks are warned about once; the stack's own hooks (transformers', peft's, the engine's) are not."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.lightning import TinyLM, batches, fit, oomb
from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of, max_relative_error

NEW = [90, 95, 96]  # the "new tokens" whose rows train
CHUNKED = "chunk"  # every warning of user_hooks says why: the model runs a chunk at a time


def mask_recipe(model, tied: bool) -> list[torch.Tensor]:
    """Freeze everything but the embedding (and the untied head), whose gradients a hook masks to the new rows;
    returns the hooks' arguments."""
    seen = []
    mask = torch.zeros(model.config.vocab_size, 1, dtype=model.dtype)
    mask[NEW] = 1

    def hook(grad):
        seen.append(grad)
        return grad * mask

    for p in model.parameters():
        p.requires_grad_(False)
    weights = {model.get_input_embeddings().weight, model.get_output_embeddings().weight}
    assert len(weights) == (1 if tied else 2)
    for w in weights:
        w.requires_grad_(True)
        w.register_hook(hook)
    return seen


def oomb_warnings(record) -> list[str]:
    return [
        str(w.message) for w in record if issubclass(w.category, UserWarning) and CHUNKED in str(w.message)
    ]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_mask_hook_on_the_lm_heads_weight_is_exact(tied):
    """float64, 5 chunks: the masked rows get exactly no gradient and the new rows the full-sequence one. Before,
    the head's gradient went into .grad past the hook: tied, the masked rows moved; untied, the hook got None."""
    model = build_causal_lm("qwen2", tie_word_embeddings=tied)
    seen = mask_recipe(model, tied)
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    full_sequence_loss(model, ids).backward()
    want = grads_of(model)
    model.zero_grad()
    seen.clear()
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    with pytest.warns(UserWarning, match="fire once per chunk"):
        engine.loss(ids).backward()
    assert seen and all(g is not None for g in seen)
    got = grads_of(model)
    assert max_relative_error(got, want) <= 1e-10
    frozen = [r for r in range(97) if r not in NEW]
    assert all(torch.equal(g[frozen], torch.zeros_like(g[frozen])) for g in got.values())


@pytest.mark.parametrize("summing", ["native", "float32", "float32-host"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_mask_hook_on_the_lm_heads_weight_holds_under_16_bit_gradient_sums(tied, summing):
    """bf16, 18 chunks (float32-host flushes after 16) and two micro-batches (gradient accumulation): the masked
    rows' .grad stays exactly zero and the new rows' is as close to float64 full-sequence training's as bf16
    full-sequence training's is (its own bf16 forward rounding dominates both)."""
    model = build_causal_lm("qwen2", dtype=torch.bfloat16, tie_word_embeddings=tied)
    reference, control = copy.deepcopy(model).double(), copy.deepcopy(model)
    for m in (model, reference, control):
        mask_recipe(m, tied)
    gen = torch.Generator().manual_seed(2)
    micro_batches = [torch.randint(0, 97, (1, 144), generator=gen) for _ in range(2)]
    for ids in micro_batches:
        full_sequence_loss(reference, ids).backward()
        full_sequence_loss(control, ids).backward()
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(8, 8, grad_accumulation=summing))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for ids in micro_batches:
            engine.loss(ids).backward()
    assert engine.config.grad_summing(18, True) == summing
    frozen = [r for r in range(97) if r not in NEW]
    got, want, bf16 = grads_of(model), grads_of(reference), grads_of(control)
    assert got.keys() == want.keys()

    def error(grad, name):
        return ((grad[NEW].double() - want[name][NEW]).norm() / want[name][NEW].norm()).item()

    for name, grad in got.items():
        assert grad.dtype == torch.bfloat16 and not grad[frozen].any(), name
        assert error(grad, name) <= 1.2 * error(bf16[name], name), name


def test_post_accumulate_grad_hooks_are_refused_before_any_work():
    """PyTorch's "optimizer step in backward" recipe would step on every chunk's partial gradient."""
    model = build_causal_lm("qwen2")
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: optimizers[p].step())
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 40))
    with pytest.raises(OOMBConfigError, match=r"model.embed_tokens.weight has a post-accumulate-grad hook"):
        engine.loss(ids)
    assert engine.pool.allocated_bytes == 0
    engine.evaluate(ids)  # no gradient: nothing to refuse
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen parameter's hook never runs
    with pytest.raises(OOMBConfigError, match=r"layers.0.self_attn.q_proj.weight has a post-accumulate"):
        engine.loss(ids)


def test_the_engines_own_post_accumulate_grad_hooks_are_not_refused():
    """bf16 chunk gradients summed in float32 by the engine's post-accumulate hooks: a step runs, and silently."""
    model = build_causal_lm("qwen2", dtype=torch.bfloat16)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(8, 8, grad_accumulation="float32"))
    ids = torch.randint(0, 97, (1, 40))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            engine.loss(ids).backward()
    assert not oomb_warnings(record)


@pytest.mark.parametrize("how", ["activate_neftune", "alpha", "hook"])
def test_neftune_is_refused(how):
    """Its noise, scaled by 1 / sqrt(tokens x hidden) of each call, would be sqrt(N / chunk) too large."""
    from transformers.integrations.neftune import activate_neftune, neftune_post_forward_hook

    model = build_causal_lm("qwen2")
    embedding = model.get_input_embeddings()
    if how == "activate_neftune":
        activate_neftune(model, 5.0)
    elif how == "alpha":
        embedding.neftune_noise_alpha = 5.0
    else:
        embedding.register_forward_hook(lambda m, i, o: neftune_post_forward_hook(m, i, o))
        embedding.register_forward_hook(neftune_post_forward_hook)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 40))
    with pytest.raises(OOMBConfigError, match="NEFTune is on for model.embed_tokens.*turn NEFTune off"):
        engine.loss(ids)
    assert engine.pool.allocated_bytes == 0
    model.eval()  # it adds no noise in eval mode: evaluations run (the user's lambda is warned about)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine.evaluate(ids)
    assert [m.split(". ")[0] for m in oomb_warnings(record)] == (
        ["hooks on the model's modules: model.embed_tokens (forward)"] if how == "hook" else []
    )


def test_user_hooks_are_warned_about_once_each():
    """Tensor hooks on trainable parameters, module hooks (a layer's, the LM head's, global ones): each warning
    once per engine, naming what it found."""
    model = build_causal_lm("qwen2")
    model.model.layers[1].register_forward_hook(lambda m, i, o: None)
    model.model.layers[0].mlp.register_full_backward_hook(lambda m, gi, go: None)
    model.lm_head.register_forward_pre_hook(lambda m, i: None)
    model.model.norm.weight.register_hook(lambda g: g * 0.5)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 40))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            engine.loss(ids).backward()
        engine.evaluate(ids)
    messages = oomb_warnings(record)
    assert len(messages) == 2
    tensor, module = sorted(messages, key=lambda m: "register_hook" not in m)
    assert "model.norm.weight" in tensor and "linear in the gradient" in tensor
    assert "model.layers.0.mlp (backward)" in module and "model.layers.1 (forward)" in module
    assert "lm_head (forward-pre; never runs)" in module

    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with pytest.warns(UserWarning, match="global forward"):
            OOMBEngine(HFChunkModel(build_causal_lm("qwen2")), OOMBConfig(16, 8)).evaluate(ids)
    finally:
        handle.remove()


@pytest.mark.parametrize("how", ["prune", "weight_norm"])
def test_a_head_weight_recomputed_by_its_hooks_is_exact(how):
    """torch's pruning and ``weight_norm`` on the LM head recompute its weight in a forward-pre hook, which never ran
    (the fused loss reads the weight without calling the head): the loss used the weight of the head's last call,
    and the second step's backward failed through that call's freed graph. Run before every read now: float64,
    3 SGD steps of 3 chunks each equal to full-sequence training, and not warned about."""

    def recompute(model):
        if how == "prune":
            torch.nn.utils.prune.l1_unstructured(model.lm_head, "weight", amount=0.3)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # (the parametrizations version is not a hook)
                torch.nn.utils.weight_norm(model.lm_head)
        return model

    base = build_causal_lm("qwen2")
    ours, full = recompute(copy.deepcopy(base)), recompute(copy.deepcopy(base))
    engine = OOMBEngine(HFChunkModel(ours), OOMBConfig(16, 8))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, full)]
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            for optimizer in optimizers:
                optimizer.zero_grad()
            engine.loss(ids).backward()
            full_sequence_loss(full, ids).backward()
            assert max_relative_error(grads_of(ours), grads_of(full)) <= 1e-10
            for optimizer in optimizers:
                optimizer.step()
    assert not oomb_warnings(record)


def test_the_heads_other_hooks_are_warned_about_whoever_set_them():
    """``spectral_norm`` (torch's) on the LM head: its power iteration never runs (it is no pure recomputation)."""
    model = build_causal_lm("qwen2")
    torch.nn.utils.spectral_norm(model.lm_head)
    with pytest.warns(UserWarning, match=r"lm_head \(forward-pre; never runs\)"):
        OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8)).evaluate(torch.randint(0, 97, (1, 40)))


def test_the_stacks_own_hooks_are_not_warned_about():
    """A plain HF model, one with HF's gradient checkpointing and ``enable_input_require_grads`` (a forward hook on
    the embedding), a peft LoRA model, and a forward hook on the top-level model (called once per model call)."""
    models = [build_causal_lm("qwen2"), build_causal_lm("llama", tie_word_embeddings=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models[1].gradient_checkpointing_enable()
    models[1].enable_input_require_grads()
    models[1].register_forward_hook(lambda m, i, o: None)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        build_causal_lm("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    models.append(lora.get_base_model())
    ids = torch.randint(0, 97, (1, 40))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for model in models:
            engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
            engine.loss(ids).backward()
            engine.evaluate(ids)
    assert not oomb_warnings(record)


class FusedOptimizerLM(TinyLM):
    """PyTorch's "optimizer step in backward" recipe in a LightningModule."""

    def __init__(self):
        super().__init__()
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: None)


def test_the_strategy_refuses_a_post_accumulate_grad_hook():
    with pytest.raises(OOMBConfigError, match="post-accumulate-grad hook"):
        fit(oomb(), FusedOptimizerLM(), batches(n=2), steps=1)
