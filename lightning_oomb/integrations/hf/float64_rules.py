"""Float64 versions of the recurrences transformers computes in float32 whatever the model's dtype — the gated
delta rule (Qwen3-Next, Qwen3.5, OLMo-Hybrid; Kimi-Linear's with a per-channel decay), the Mamba2 scan (Falcon-H1, Bamba, Granite 4, Nemotron-H) and
Mamba-1's selective scan (Mamba, Falcon-Mamba, Jamba) —
token by token in the inputs' dtype, with the same signatures, and the float32 modules around Kimi-Linear's and the
Bailing hybrids' rule (:data:`FLOAT64_FORWARDS`). The self-check swaps them into a float64 twin, so
that chunking the twin changes nothing but float64 rounding and a dropped or misplaced state shows (the test
suite's oracle too)."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F


def float64_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
    """The gated delta rule, ``[B, N, heads, dim]`` inputs, its decay ``g`` per head ``[B, N, heads]`` or per key
    channel ``[B, N, heads, dk]`` (Kimi-Linear's); returns ``(output, final state or None)``."""
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query, key = query.repeat_interleave(hv // hk, 2), key.repeat_interleave(hv // hk, 2)
    if use_qk_l2norm_in_kernel:
        query, key = F.normalize(query, dim=-1, eps=1e-6), F.normalize(key, dim=-1, eps=1e-6)
    query = query * query.shape[-1] ** -0.5
    b, n, h, dk = key.shape
    state = (
        query.new_zeros(b, h, dk, value.shape[-1]) if initial_state is None else initial_state.to(query.dtype)
    )
    outs = []
    for t in range(n):
        decay = g[:, t].to(query.dtype).exp()
        state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        delta = (value[:, t] - (state * key[:, t, ..., None]).sum(-2)) * beta[:, t][..., None]
        state = state + key[:, t, ..., None] * delta[..., None, :]
        outs.append((state * query[:, t, ..., None]).sum(-2))
    return torch.stack(outs, 1), (state if output_final_state else None)


def float64_ssd_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                     dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):  # fmt: skip
    """The Mamba2 (SSD) scan; returns the output (and the final state if asked)."""
    heads = hidden_states.shape[2]
    dt = dt if dt_bias is None else dt + dt_bias
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    A = A.to(hidden_states.dtype)
    B, C = (x.repeat_interleave(heads // x.shape[2], 2) for x in (B, C))
    b, n, h, p = hidden_states.shape
    state = hidden_states.new_zeros(b, h, p, B.shape[-1]) if initial_states is None else initial_states
    ys = []
    for t in range(n):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = state * decay + (dt[:, t, :, None] * hidden_states[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    y = y if D is None else y + D[..., None] * hidden_states
    return (y, state) if return_final_states else y


def float64_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False, **kwargs):  # fmt: skip
    """Mamba-1's selective scan from a zero state, ``[B, I, L]`` inputs and ``B``, ``C`` ``[B, N, L]``; returns
    the output (and the final state if asked)."""
    dt = dt if delta_bias is None else dt + delta_bias[..., None]
    dt = F.softplus(dt) if delta_softplus else dt
    A = A.to(hidden_states.dtype)
    state = hidden_states.new_zeros(*hidden_states.shape[:2], A.shape[-1])
    ys = []
    for t in range(hidden_states.shape[-1]):
        state = (
            state * torch.exp(dt[..., t, None] * A)
            + (dt[..., t] * hidden_states[..., t])[..., None] * B[:, None, :, t]
        )
        ys.append((state * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1)
    y = y if D is None else y + D[:, None] * hidden_states
    y = y if z is None else y * F.silu(z)
    return (y, state) if return_last_state else y


def declined_fused_scan(*args, **kwargs) -> None:
    """A fused training shortcut declined (pure Mamba2's ``mamba2_split_conv1d_scan_combined``, Mamba-1's
    ``mamba_inner_fn``): the mixer then takes its torch path, whose scan is :func:`float64_ssd_scan` /
    :func:`float64_selective_scan`."""
    return None


FLOAT64_RULES = {  # transformers' module-level function -> its float64 version
    "torch_chunk_gated_delta_rule": float64_delta_rule,
    "torch_recurrent_gated_delta_rule": float64_delta_rule,
    "chunk_kimi_delta_attention": float64_delta_rule,
    "recurrent_kimi_delta_attention": float64_delta_rule,
    "mamba2_chunk_scan": float64_ssd_scan,
    "mamba2_split_conv1d_scan_combined": declined_fused_scan,
    "mamba_selective_scan": float64_selective_scan,
    "mamba_inner_fn": declined_fused_scan,
}


def float64_kimi_forget_gate(self, hidden_states):
    """Kimi-Linear's forget gate (its per-channel log decay, ``-exp(A_log) softplus(f + dt_bias)``, capped softplus
    as transformers computes it) in the inputs' dtype: transformers computes it in float32."""
    g = self.f_b_proj(self.f_a_proj(hidden_states)) + self.dt_bias.view(1, 1, -1)
    g = g.view(*hidden_states.shape[:2], -1, self.head_dim)
    return -torch.exp(self.A_log) * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def float64_bailing_forget_gate(self, hidden_states):
    """The Bailing hybrids' forget gate (``lower_bound sigmoid(exp(A_log) (f + dt_bias))`` with ``kda_safe_gate``,
    else ``-exp(A_log) softplus(f + dt_bias)``) in the inputs' dtype: transformers computes it in float32."""
    g = self.f_proj(hidden_states).view(*hidden_states.shape[:2], self.num_heads, self.head_dim)
    g = g + self.dt_bias.view(1, 1, self.num_heads, self.head_dim)
    decay = self.A_log.exp().view(1, 1, self.num_heads, 1)
    return self.lower_bound * torch.sigmoid(decay * g) if self.safe_gate else -decay * F.softplus(g)


def in_input_dtype(forward):
    """``forward`` (a class's own) with ``torch.float32`` read as its input's dtype: a module that casts to float32
    by that name (Kimi-Linear's router, gated norm, delta rule's outgoing state) computes in float64 in a float64
    twin."""

    @functools.wraps(forward)
    def run(self, hidden_states, *args, **kwargs):
        with mock.patch.object(torch, "float32", hidden_states.dtype):
            return forward(self, hidden_states, *args, **kwargs)

    return run


def float_in_input_dtype(forward):
    """``forward`` (a class's own) with ``Tensor.float()`` read as a cast to its input's dtype when that is float64:
    a module that rounds a term to float32 per token (the Bailing hybrids' attention output gate,
    ``sigmoid(g_proj(x).float())``) computes it in float64 in a float64 twin — a float32 rounding that inputs
    differing by float64 rounding (chunked or not) could cross at different ulps."""

    @functools.wraps(forward)
    def run(self, hidden_states, *args, **kwargs):
        if hidden_states.dtype != torch.float64:
            return forward(self, hidden_states, *args, **kwargs)
        with mock.patch.object(torch.Tensor, "float", lambda t, *_, **__: t.to(torch.float64)):
            return forward(self, hidden_states, *args, **kwargs)

    return run


FLOAT64_FORWARDS = {  # transformers' class computing in float32 -> its forward in the inputs' dtype
    "KimiLinearForgetGate": float64_kimi_forget_gate,
    # made from the class's own forward: its gated norm, its delta rule's outgoing state, its router
    "KimiLinearRMSNormGated": in_input_dtype,
    "KimiLinearDeltaAttention": in_input_dtype,
    "KimiLinearTopkRouter": in_input_dtype,
    "BailingHybridForgetGate": float64_bailing_forget_gate,
    "BailingHybridRMSNormGated": in_input_dtype,
    "BailingHybridDeltaAttention": in_input_dtype,
    "BailingHybridTopkRouter": in_input_dtype,
    "BailingHybridAttention": float_in_input_dtype,
}


def float32_rules_of(model: torch.nn.Module) -> list[str]:
    """The names of :data:`FLOAT64_RULES` and :data:`FLOAT64_FORWARDS` that ``model``'s transformers module
    defines."""
    module = importlib.import_module(type(model).__module__)
    return [name for name in (*FLOAT64_RULES, *FLOAT64_FORWARDS) if hasattr(module, name)]


@contextlib.contextmanager
def float64_recurrences(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs, ``model``'s module computes its recurrences with :data:`FLOAT64_RULES` and
    :data:`FLOAT64_FORWARDS` (every model of that module: use it on a twin or in a test)."""
    module = importlib.import_module(type(model).__module__)
    with contextlib.ExitStack() as patches:
        for name in float32_rules_of(model):
            if name in FLOAT64_FORWARDS:
                cls, forward = getattr(module, name), FLOAT64_FORWARDS[name]
                forward = (
                    forward(cls.forward) if forward in (in_input_dtype, float_in_input_dtype) else forward
                )
                patches.enter_context(mock.patch.object(cls, "forward", forward))
            else:
                patches.enter_context(mock.patch.object(module, name, FLOAT64_RULES[name]))
        yield
