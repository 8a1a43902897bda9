"""Multi-head latent attention attended over its latent: ``OOMBConfig.mla_pages="latent"``.

A latent attention layer (DeepSeek-V2/V3 and the families built like it) makes each token's keys and values from one
normed latent ``c [kv_lora_rank]`` and one rotated key part ``k_rot [qk_rope_head_dim]`` shared by all heads:
``k_h = [c W_k,h, k_rot]``, ``v_h = c W_v,h`` with ``kv_b_proj``'s weight ``[W_k,h; W_v,h]`` per head. Since
``q_h . k_h = [q_nope,h W_k,h^T, q_rot,h] . [c, k_rot]`` and ``sum_j p_j v_j,h = (sum_j p_j c_j) W_v,h^T``, a layer
attends exactly as well with one KV head of ``kv_lora_rank + qk_rope_head_dim`` values — the latent, serving as key
and value — queried by ``[q_nope,h W_k,h^T, q_rot,h]``, its output's first ``kv_lora_rank`` columns times ``W_v,h^T``
(what DeepSeek's inference calls absorbing the weights). The pages then hold that one head instead of every head's
keys and values.

The model's own forward is left as it is: a forward pre-hook on ``kv_b_proj`` keeps its input (the latent) for the
attention call that follows, which takes ``k_rot`` from the keys it is given (head 0's last columns) and the weight
as ``kv_b_proj`` maps the identity (so a LoRA adapter on it is included and trained). The keys and values the model
expanded for the chunk are left unused (no gradient flows through them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from lightning_oomb.engine.errors import OOMBConfigError

LATENT_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# id of an attention module attending over latents -> the latent its kv_b_proj was last called with (None: taken)
LATENTS: dict[int, torch.Tensor | None] = {}


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a multi-head latent attention module: a ``kv_b_proj`` and the latent's sizes."""
    return hasattr(module, "kv_b_proj") and all(
        isinstance(getattr(module, f, None), int) for f in LATENT_FIELDS
    )


def latent_width(module: torch.nn.Module) -> int:
    """The width of a latent attention layer's one head of latent pages: ``kv_lora_rank + qk_rope_head_dim``."""
    return module.kv_lora_rank + module.qk_rope_head_dim


def check_latent_modules(modules: list[torch.nn.Module], model_name: str) -> None:
    """Refuse ``mla_pages="latent"`` for a model whose attention modules are not all latent attention, or whose
    ``kv_b_proj`` drops inputs out (a LoRA adapter's dropout: it would drop latent columns, not a token's)."""
    if not modules or not all(is_latent_attention(m) for m in modules):
        raise OOMBConfigError(
            f"mla_pages='latent' needs multi-head latent attention layers (DeepSeek-V2/V3-like: a kv_b_proj and "
            f"kv_lora_rank), and {model_name}'s attention layers are not all such layers — use "
            "mla_pages='expanded' (or 'auto', the strategies' default)."
        )
    for module in modules:
        dropping = [m for m in module.kv_b_proj.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if dropping:
            raise OOMBConfigError(
                f"mla_pages='latent' with dropout on {model_name}'s kv_b_proj (p={dropping[0].p}, e.g. LoRA's "
                "lora_dropout): the absorbed weight would drop the latent's columns instead of each token's — set "
                "the adapter's dropout to 0, leave kv_b_proj out of its target modules, or use "
                "mla_pages='expanded' (with 'auto' the memory plan chose latents: the expanded pages do not fit)."
            )


@contextlib.contextmanager
def keeping_latents(modules: list[torch.nn.Module]) -> Iterator[None]:
    """For the block, each of ``modules``' ``kv_b_proj`` keeps its input in :data:`LATENTS` (hooks removed and
    latents dropped afterwards)."""

    def keep(owner: int) -> Callable:
        def hook(_, args):
            if owner not in _ABSORBING:  # (not the identity mapped while its weight is read)
                LATENTS[owner] = args[0]

        return hook

    LATENTS.update((id(m), None) for m in modules)
    handles = [m.kv_b_proj.register_forward_pre_hook(keep(id(m))) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            LATENTS.pop(id(module), None)


_ABSORBING: set[int] = set()  # ids of the modules whose kv_b_proj maps the identity now: no latent to keep


def _weight(module: torch.nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kv_b_proj``'s weight as it maps a latent, ``[kv_lora_rank, heads, nope + v]``: the identity mapped (an
    adapter's update included, with its gradient); and where ``kv_b_proj`` adds a bias (a user's ``Linear`` with
    one, LoRA's ``lora_bias``) that bias ``[heads, nope + v]``, mapped from a zero row and taken off the weight."""
    rank = module.kv_lora_rank
    biased = any(getattr(m, "bias", None) is not None for m in module.kv_b_proj.modules())
    eye = torch.eye(rank, dtype=like.dtype, device=like.device)
    _ABSORBING.add(id(module))
    try:
        mapped = module.kv_b_proj(F.pad(eye, (0, 0, 0, 1)) if biased else eye)
    finally:
        _ABSORBING.discard(id(module))
    width = module.qk_nope_head_dim + module.v_head_dim
    if not biased:
        return mapped.view(rank, -1, width), None
    bias = mapped[rank:]
    return (mapped[:rank] - bias).view(rank, -1, width), bias.view(-1, width)


def attend_latent(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    check: bool,
    shift_free: bool = True,
) -> torch.Tensor:
    """The attention output ``[B, L, Hq, value width]`` of a latent attention call given the model's ``query
    [B, Hq, L, nope + rope]``, expanded ``key`` and ``value`` (only ``key``'s rotated part is read), attending with
    ``attend(q, kv) -> out`` over one latent head (``q [B, Hq, L, rank + rope]``, ``kv [B, 1, L, rank + rope]``).
    ``check``: compare the latent against the keys the model expanded from it (first and last token), which finds
    a model whose ``kv_b_proj`` input is not the latent the keys are made of. A bias of ``kv_b_proj``: its value
    half is added to the output (the probabilities sum to 1), its key half shifts all of a query's scores alike and
    is left out — exact where the scores are ``shift_free`` (no softcap, no sink logits), else refused."""
    latent = LATENTS.get(id(module))
    LATENTS[id(module)] = None
    batch, heads, length, _ = query.shape
    nope, rank = module.qk_nope_head_dim, module.kv_lora_rank
    if latent is None or latent.numel() != batch * length * rank:
        raise OOMBConfigError(
            f"{type(module).__name__} attended without calling kv_b_proj on this chunk's latent first, so "
            "mla_pages='latent' cannot find the latent its keys are made of — use mla_pages='expanded'."
        )
    latent = latent.reshape(batch, 1, length, rank)
    weight, bias = _weight(module, latent)
    w_keys, w_values = weight[..., :nope], weight[..., nope:]
    if bias is not None and not shift_free:
        raise OOMBConfigError(
            f"mla_pages='latent' with a bias on {type(module).__name__}'s kv_b_proj and a softcap or sink logits: "
            "the key bias's share of the scores cannot be left out — use mla_pages='expanded'."
        )
    if check:
        _check_latent(module, latent, key[..., :nope], w_keys, None if bias is None else bias[:, :nope])
    rope = module.qk_rope_head_dim
    # per head, zero rows where the other operand's columns are rotated ones: each product reads a whole tensor
    # (no sliced copy for autograd to save beside the query and the op's output, which it keeps anyway)
    absorb = F.pad(w_keys.permute(1, 2, 0), (0, 0, 0, rope)).to(query.dtype)  # [Hq, nope + rope, rank]
    q = torch.cat((query @ absorb, query[..., nope:]), dim=-1)
    kv = torch.cat((latent.to(key.dtype), key[:, :1, :, nope:]), dim=-1)
    out = attend(q, kv)
    expand = F.pad(w_values.permute(1, 0, 2), (0, 0, 0, rope)).to(out.dtype)  # [Hq, rank + rope, v]
    out = out @ expand
    if bias is not None:
        out = out + bias[:, None, nope:].to(out.dtype)
    out = out.transpose(1, 2)
    return F.pad(out, (0, value.shape[-1] - out.shape[-1])) if value.shape[-1] > out.shape[-1] else out


def _check_latent(module, latent: torch.Tensor, keys: torch.Tensor, w_keys: torch.Tensor, b_keys) -> None:
    with torch.no_grad():
        ends = [0, latent.shape[2] - 1]
        made = torch.einsum("bxlr,rhd->bhld", latent[:, :, ends].to(w_keys.dtype), w_keys)
        made = (made if b_keys is None else made + b_keys[:, None]).to(keys.dtype)
        given = keys[:, :, ends]
        scale = given.abs().amax().clamp_min(torch.finfo(given.dtype).tiny)
        tolerance = min(latent.shape[-1] * torch.finfo(given.dtype).eps, 0.125)  # (summed in another order)
        if not bool(((made - given).abs().amax() / scale <= tolerance).item()):
            raise OOMBConfigError(
                f"{type(module).__name__}'s keys are not kv_b_proj of the latent it was called with (a model that "
                "makes its keys otherwise), so mla_pages='latent' cannot attend over the latent — use "
                "mla_pages='expanded'."
            )
