"""Offload stress check: 20 steps with offload vs without must give the same gradients (a race shows as error).

Every copy and every compute access of the offloader gets a random ``torch.cuda._sleep`` delay, so a missing
event wait turns into wrong numbers. Pass criteria per step: forward-sweep loss bitwise equal (no atomics in the
forward); gradient error of each offload configuration vs the reference <= 2x the reference's own run-to-run noise
(atomic dK/dV adds) + 1e-6. Also checks that ``release()`` followed by another step works, and reports step time,
peak memory, pool sizes, bytes copied each way, copy-wait seconds and on-demand copies per configuration.

    PYTHONPATH=$PWD python3 benchmarks/offload_stress.py --out benchmarks/results/offload-stress-h200.json
    python benchmarks/offload_stress.py --device cpu --tiny --steps 2   # logic check on CPU
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.kv_pool import PoolShape, resolve_grad_dtype
from lightning_oomb.engine.offload import Offloader
from lightning_oomb.integrations.hf import HFChunkModel

CONFIGS = {
    "ref": {},
    "ref_again": {},  # noise floor of the atomic adds
    "host_all_2buf": dict(offload=True, hbm_budget=0, staging_buffers=2),
    "host_all_2buf_ckpt": dict(offload=True, hbm_budget=0, staging_buffers=2, ckpt=True),
    "mixed_3buf": dict(offload=True, hbm_budget="mixed", staging_buffers=3),
    "host_all_1buf": dict(offload=True, hbm_budget=0, staging_buffers=1),
}


def add_random_delays() -> None:
    """Delay every copy (on the copy stream) and every access (on the compute stream) by a random time."""
    move, access = Offloader._move, Offloader.access

    def slow_move(self, *a, **k):
        torch.cuda._sleep(random.randint(0, 200_000))
        return move(self, *a, **k)

    def slow_access(self, *a, **k):
        torch.cuda._sleep(random.randint(0, 200_000))
        return access(self, *a, **k)

    Offloader._move, Offloader.access = slow_move, slow_access


def run_step(model, engine, ids, cuda: bool):
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = engine.loss(ids)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return loss.detach(), grads, seconds, torch.cuda.max_memory_allocated() if cuda else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.tiny:
        shape = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        seq, chunk, page, vocab, dtype = 200, 64, 16, 101, torch.float64
    else:
        shape = dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
        seq, chunk, page, vocab, dtype = 16384, 2048, 128, 32000, torch.bfloat16
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, attn_implementation="sdpa", **shape)).to(
        device, dtype
    )
    if cuda:
        add_random_delays()
    layers = shape["num_hidden_layers"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    layer_bytes = PoolShape(
        layers,
        1,
        seq,
        shape["num_key_value_heads"],
        head_dim,
        page,
        dtype,
        resolve_grad_dtype("float32", dtype),
    ).layer_bytes

    engines, rows, worst = {}, {}, {}
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (1, seq), device=device)
        results = {}
        for name, options in CONFIGS.items():
            options = dict(options)
            ckpt = options.pop("ckpt", False)
            if options.get("hbm_budget") == "mixed":
                options["hbm_budget"] = layer_bytes * (layers // 2 + options["staging_buffers"])
            if name not in engines:
                adapter = HFChunkModel(model, layer_checkpointing=ckpt)
                engines[name] = OOMBEngine(adapter, OOMBConfig(chunk, page, **options))
            results[name] = run_step(model, engines[name], ids, cuda)
            stats = engines[name].stats
            rows[name] = dict(
                step_s=results[name][2],
                peak_gib=results[name][3] / 2**30,
                pool_gib=stats.pool_bytes / 2**30,
                **stats.extra,
            )
        ref_loss, ref_grads = results["ref"][:2]
        scale = ref_grads.abs().max().item()
        noise = (results["ref_again"][1] - ref_grads).abs().max().item() / scale
        for name, (loss, grads, *_) in results.items():
            err = (grads - ref_grads).abs().max().item() / scale
            worst[name] = max(worst.get(name, 0.0), err)
            assert torch.equal(loss, ref_loss) and err <= 2 * noise + 1e-6, (
                f"step {step} {name}: loss {loss.item()} vs {ref_loss.item()}, grad err {err:.3e} (noise {noise:.3e})"
            )
        print(f"step {step}: ok (noise {noise:.2e}, worst offload err {max(worst.values()):.2e})", flush=True)

    if cuda:  # release unpins host memory; the next step re-reserves
        engines["host_all_2buf"].release()
        run_step(model, engines["host_all_2buf"], torch.randint(0, vocab, (1, seq), device=device), cuda)
    report = {"steps": args.steps, "worst_rel_grad_err": worst, "last_step": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=float))
    print(
        f"{'config':20s} {'step s':>7s} {'peak GiB':>9s} {'dev pool':>9s} {'host pool':>9s} {'H2D GiB':>8s} "
        f"{'D2H GiB':>8s} {'wait s':>7s} {'demand':>6s}"
    )
    for name, r in rows.items():
        device_pool = (r.get("hbm_pool_bytes", 0) + r.get("staging_bytes", 0)) / 2**30
        print(
            f"{name:20s} {r['step_s']:7.2f} {r['peak_gib']:9.2f} {device_pool:9.2f} "
            f"{r.get('host_pool_bytes', 0) / 2**30:9.2f} {r.get('h2d_bytes', 0) / 2**30:8.2f} "
            f"{r.get('d2h_bytes', 0) / 2**30:8.2f} {r.get('copy_wait_s', 0):7.3f} {r.get('demand_copies', 0):6d}"
        )


if __name__ == "__main__":
    main()
