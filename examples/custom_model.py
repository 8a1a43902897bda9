"""Train your own PyTorch model — not a Hugging Face one — with ``Trainer(strategy="oomb")``.

A small GPT (RoPE, RMSNorm, grouped-query attention, SwiGLU) written in plain torch. Three things make it
trainable by OOMB, all in this file:

1. its attention calls ``lightning_oomb.engine.paged_attention(q, k, v, chunk, layer_idx, scale)`` when the engine
   passes a chunk context (post-RoPE ``q [B, Hq, L, D]``, ``k, v [B, Hkv, L, D]``; positions are absolute);
2. it tells the engine its shape (``num_layers``, ``kv_heads``, ``head_dim``, ``vocab_size``, ``num_embeddings``)
   and gives it ``hidden_states(input_ids, position_ids, chunk)`` (final normed hidden states) and ``lm_head()``;
3. it inherits ``ManagedModelMixin``, so inside the strategy's ``training_step`` a call ``self.model(input_ids,
   labels)`` returns the engine's exact loss, and ``layer_checkpointing`` follows the strategy's option.

Its ordinary ``forward`` (full sequence, SDPA) is what any other strategy trains. The script first checks in
float64 that OOMB's gradients equal that ordinary training's, then trains the model with the strategy on the
demo's retrieval task. On a CPU (well under a minute):

    python examples/custom_model.py
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_oomb import OOMBStrategy
from lightning_oomb.data import NeedleRetrievalDataModule
from lightning_oomb.engine import (
    ChunkContext,
    LMHead,
    ManagedModelMixin,
    OOMBConfig,
    OOMBEngine,
    paged_attention,
)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.layer_idx = heads, kv_heads, dim // heads, layer_idx
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin, chunk: ChunkContext | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scale = self.head_dim**-0.5
        if chunk is None:  # ordinary full-sequence attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # OOMB: this chunk's queries against every page of this layer, plus the chunk's own k, v
            out = paged_attention(q, k, v, chunk, self.layer_idx, scale)
        return self.out(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, layer_idx: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, layer_idx)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin, chunk=None):
        x = x + self.attn(self.norm1(x), cos, sin, chunk)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class TinyGPT(ManagedModelMixin, nn.Module):
    """A decoder-only LM; ``forward(input_ids, labels=None)`` returns the mean next-token loss."""

    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 128, rope_base: float = 10_000.0) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden, i) for i in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer(
            "inv_freq", rope_base ** -(torch.arange(0, dim // heads, 2) / (dim // heads)), False
        )
        # the engine's view of the model (OOMB's model protocol)
        self.num_layers, self.kv_heads, self.head_dim = layers, kv_heads, dim // heads
        self.vocab_size = self.num_embeddings = vocab

    def hidden_states(self, input_ids, position_ids, chunk: ChunkContext | None = None) -> torch.Tensor:
        """Final normed hidden states ``[B, L, dim]`` at absolute ``position_ids [1 | B, L]``."""
        angles = position_ids[..., None].to(self.inv_freq.dtype) * self.inv_freq
        cos, sin = (
            torch.cat((f, f), -1)[:, None].to(self.embed.weight.dtype) for f in (angles.cos(), angles.sin())
        )
        x = self.embed(input_ids)
        for block in self.blocks:
            # the attention then runs twice per chunk
            if self.layer_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, chunk, use_reentrant=False)
            else:
                x = block(x, cos, sin, chunk)
        return self.norm(x)

    def lm_head(self) -> LMHead:
        return LMHead(self.head.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        labels = input_ids if labels is None else labels
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        logits = self.head(self.hidden_states(input_ids, positions))[:, :-1]
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )


class LitGPT(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about OOMB."""

    def __init__(self, vocab: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.model, self.lr = TinyGPT(vocab), lr

    def training_step(self, batch):
        loss = self.model(batch["input_ids"], batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch):
        self.log("val_loss", self.model(batch["input_ids"], batch["labels"]), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def gradient_check(seq_len: int, chunk_size: int) -> float:
    """Max relative difference between OOMB's gradients and ordinary full-sequence training's, in float64."""
    model = TinyGPT(vocab=97).double()
    ids = torch.randint(0, 97, (2, seq_len), generator=torch.Generator().manual_seed(0))
    model(ids).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    OOMBEngine(model, OOMBConfig(chunk_size=chunk_size, page_size=16)).loss(ids).backward()
    return max(
        ((p.grad - want[n]).abs().max() / want[n].abs().max()).item() for n, p in model.named_parameters()
    )


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    error = gradient_check(seq_len=200, chunk_size=48)
    print(
        f"float64 gradients, 5 chunks of OOMB vs full-sequence training: max relative difference {error:.1e}"
    )
    data = NeedleRetrievalDataModule(seq_len=args.seq_len, train_samples=args.steps * 4, val_samples=4, batch_size=4,
                                     needle_fraction=1 / 16)  # fmt: skip
    trainer = L.Trainer(
        strategy=OOMBStrategy(chunk_size=args.chunk_size, page_size=64, layer_checkpointing=True),
        accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=False,
    )  # fmt: skip
    module = LitGPT(data.vocab_size)
    trainer.fit(module, data)
    val = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    print(f"held-out loss {val:.3f} after {args.steps} OOMB steps of 4 x {args.seq_len} tokens in chunks of "
          f"{args.chunk_size} (no-context baseline {data.baseline_loss:.3f})")  # fmt: skip
    return error


if __name__ == "__main__":
    main()
