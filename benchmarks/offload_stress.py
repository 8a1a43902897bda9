"""Offload stress check: 20 steps with offload, with and without random stream delays (a race shows as error).

The delayed runs use the engine's ``delaying_transport``: on CUDA every copy and every compute-stream wait on a
staging buffer gets a random ``torch.cuda._sleep``; on CPU every copy runs at a random later moment (before
anything waits for it). Either way a missing event wait turns into wrong numbers. Each offload configuration runs
every step twice, without and with delays (two engines, the same options); the kernels have no atomics, so the
two must agree to the model's own run-to-run noise (two identical no-offload runs, ``ref`` and ``ref_again``; 0
when everything is deterministic). The error of each
configuration against no offload (block-wise log-sum-exp merges: rounding only) is reported. Also checks that
``release()`` followed by another step works, and reports step time, peak memory, pool sizes, bytes copied each
way, copy-wait seconds and on-demand copies per configuration.

    PYTHONPATH=$PWD python3 benchmarks/offload_stress.py --out benchmarks/results/offload-stress-h200.json
    python benchmarks/offload_stress.py --device cpu --tiny --steps 2   # logic check on CPU
"""

from __future__ import annotations

import argparse
import functools
import gzip
import shutil
from pathlib import Path

import torch

from benchmarks.common import GIB, build_qwen2, hbm_budget_for, timed, write_json
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.offload import default_transport, delaying_transport
from lightning_oomb.engine.pages import PoolShape
from lightning_oomb.integrations.hf import HFChunkModel

CONFIGS = {
    "ref": {},
    "ref_again": {},  # the model's run-to-run noise floor
    "host_all_2buf": dict(offload=True, hbm_budget=0, staging_buffers=2),
    "host_all_3buf_ckpt": dict(offload=True, hbm_budget=0, staging_buffers=3, layer_checkpointing=True),
    "mixed_3buf": dict(offload=True, hbm_budget="mixed", staging_buffers=3),
    "host_all_4buf": dict(offload=True, hbm_budget=0, staging_buffers=4),
    "host_all_4buf_ckpt": dict(offload=True, hbm_budget=0, staging_buffers=4, layer_checkpointing=True),
    "host_all_9buf_ckpt": dict(
        offload=True, hbm_budget=0, staging_buffers=9, layer_checkpointing=True
    ),  # 4 a call
}


def run_step(model, engine, ids, device: torch.device):
    """One training step: ``(loss, all gradients flattened in float64, seconds, peak device bytes)``."""
    model.zero_grad(set_to_none=True)

    def step():
        loss = engine.loss(ids)
        loss.backward()
        return loss.detach()

    seconds, peak, loss = timed(step, device)
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    return loss, grads, seconds, peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write a gzipped Chrome trace (Perfetto) of one host_all_4buf step: the streams' timeline",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
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
    model = build_qwen2(device, dtype, {"vocab_size": vocab, **shape})
    layers = shape["num_hidden_layers"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    pool_shape = PoolShape(layers, 1, seq, shape["num_key_value_heads"], head_dim, page, chunk, dtype=dtype)

    def make_engine(options: dict, transport=default_transport) -> OOMBEngine:
        options = dict(options)
        if options.get("hbm_budget") == "mixed":  # half the layers on the device
            options["hbm_budget"] = hbm_budget_for(layers // 2, pool_shape, options["staging_buffers"])
        adapter = HFChunkModel(
            model, layer_checkpointing=options.get("layer_checkpointing", False), verify_exactness=False
        )  # (as benchmarks/common.py)
        return OOMBEngine(adapter, OOMBConfig(chunk, page, **options), transport)

    engines = {name: make_engine(options) for name, options in CONFIGS.items()}
    delayed = {
        name: make_engine(options, functools.partial(delaying_transport, seed=i))
        for i, (name, options) in enumerate(CONFIGS.items())
        if options
    }
    rows, race, vs_ref = {}, {}, {}
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (1, seq), device=device)
        ref_loss, ref_grads, *_ = run_step(model, engines["ref"], ids, device)
        scale = ref_grads.abs().max().item()
        noise = (run_step(model, engines["ref_again"], ids, device)[1] - ref_grads).abs().max().item() / scale
        for name, engine in delayed.items():
            calm = run_step(model, engines[name], ids, device)
            loss, grads, seconds, peak = run_step(model, engine, ids, device)
            err = (grads - calm[1]).abs().max().item() / scale
            race[name] = max(race.get(name, 0.0), err)
            vs_ref[name] = max(vs_ref.get(name, 0.0), (calm[1] - ref_grads).abs().max().item() / scale)
            loss_err = abs(loss.item() - calm[0].item()) / abs(calm[0].item())
            assert err <= 2 * noise and loss_err <= 2 * noise, (
                f"step {step} {name}: with delays loss {loss.item()} vs {calm[0].item()}, grad err {err:.3e} "
                f"(noise {noise:.3e}) — a copy is not ordered by its events"
            )
            stats = engines[name].stats
            rows[name] = dict(
                step_s=calm[2], peak_gib=calm[3] / GIB, pool_gib=stats.pool_bytes / GIB, **stats.extra
            )
        print(
            f"step {step}: ok (noise {noise:.2e}, worst delayed-vs-calm {max(race.values()):.2e}, "
            f"worst offload-vs-no-offload {max(vs_ref.values()):.2e})",
            flush=True,
        )

    if args.trace:  # compute and copy streams side by side: do the copies hide behind the kernels?
        ids = torch.randint(0, vocab, (1, seq), device=device)
        kind = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[kind]) as prof:
            run_step(model, engines["host_all_4buf"], ids, device)
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        raw = args.trace.with_suffix(".tmp.json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(args.trace, "wb") as dst:  # Perfetto opens .json.gz
            shutil.copyfileobj(src, dst)
        raw.unlink()
    if cuda:  # release unpins host memory; the next step re-reserves
        engines["host_all_4buf"].release()
        run_step(model, engines["host_all_4buf"], torch.randint(0, vocab, (1, seq), device=device), device)
    report = {
        "command": "benchmarks/offload_stress.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "steps": args.steps,
        "worst_rel_grad_err_delayed_vs_calm": race,
        "worst_rel_grad_err_vs_no_offload": vs_ref,
        "last_step": rows,
    }
    if args.out:
        write_json(args.out, report)
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
