"""Step time and tokens/s of HolmesStrategy (pp=2 x dp=2) next to Lightning's DDPStrategy, measured side by side.

Same 4 local processes (two_cluster_mixed on plain loopback, gloo), same GPT recipe, global batch and steps; random
byte tokens so nothing is read or downloaded. Warm-up steps are excluded and the median step is reported.

    OMP_NUM_THREADS=1 python bench/holmes_vs_ddp.py [--steps 30] [--warmup 5] [--global-batch 16] [--d-model 128]

Writes outputs/bench/holmes_vs_ddp.json and .png, and prints the table with the ratio Holmes / DDP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench"
CLUSTER = "two_cluster_mixed"
STRATEGIES = ("holmes", "ddp")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank-run", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup={args.warmup} must be below --steps={args.steps}")
    return args


def rank_run(args: argparse.Namespace) -> None:
    """One rank of one strategy: train, time every step on rank 0, write the medians."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from holmes_lightning import HolmesStrategy
    from holmes_lightning.bench.worker import StepTimer
    from recipes import GPT

    L.seed_everything(0)
    model = GPT(n_layers=args.n_layers, d_model=args.d_model, n_heads=4, seq_len=args.seq_len, warmup_steps=1)
    if args.rank_run == "holmes":
        strategy = HolmesStrategy(
            cluster=CLUSTER, pp=2, dp=2, global_batch=args.global_batch, microbatches=args.microbatches, timeout=120
        )
        replicas = 2
    else:
        strategy, replicas = DDPStrategy(process_group_backend="gloo"), 4
    tokens = torch.randint(0, 256, (args.steps * args.global_batch, args.seq_len + 1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    timer = StepTimer(args.rank_run, args.steps, trace_step=None, trace_path=OUT / "unused")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=4,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, DataLoader(data, batch_size=args.global_batch // replicas, drop_last=True))
    if trainer.is_global_zero:
        steps = timer.seconds[args.warmup + 1 :]  # the same intervals as end-to-end differences after warm-up
        step_s = statistics.median(steps)
        result = {"step_s": step_s, "tokens_per_s": args.global_batch * args.seq_len / step_s, "steps": steps}
        if args.rank_run == "holmes":
            result["plan"] = f"pp={strategy.plan.pp} x dp={strategy.plan.dp}, {strategy.plan.microbatches} mb"
        (OUT / f"{args.rank_run}.json").write_text(json.dumps(result))


def main() -> int:
    args = arguments()
    if args.rank_run:
        rank_run(args)
        return 0
    from holmes_lightning.launch import launch
    from holmes_lightning.topology import Topology

    OUT.mkdir(parents=True, exist_ok=True)
    topology = Topology.from_config(CLUSTER)
    results = {}
    for name in STRATEGIES:
        print(f"bench: {name} on {topology.world_size} processes, {args.steps} steps", flush=True)
        code = launch([sys.executable, __file__, *sys.argv[1:], "--rank-run", name], topology)
        if code != 0:
            print(f"bench: the {name} run failed with exit code {code}", file=sys.stderr)
            return code
        results[name] = json.loads((OUT / f"{name}.json").read_text())
    report(args, results)
    return 0


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    holmes, ddp = results["holmes"], results["ddp"]
    lines = [
        f"GPT {args.n_layers}x{args.d_model}, seq {args.seq_len}, global batch {args.global_batch}, "
        f"median of {args.steps - args.warmup - 1} steps after {args.warmup} warm-up ({CLUSTER}, loopback, gloo)",
        f"  {'strategy':<34}{'step ms':>10}{'tokens/s':>12}",
        f"  {'HolmesStrategy ' + holmes['plan']:<34}{holmes['step_s'] * 1e3:>10.1f}{holmes['tokens_per_s']:>12,.0f}",
        f"  {'DDPStrategy dp=4':<34}{ddp['step_s'] * 1e3:>10.1f}{ddp['tokens_per_s']:>12,.0f}",
        f"  Holmes / DDP tokens/s: {holmes['tokens_per_s'] / ddp['tokens_per_s']:.2f}",
    ]
    print("\n".join(lines))
    (OUT / "holmes_vs_ddp.json").write_text(json.dumps({"args": vars(args), **results}, indent=2))
    figure, axis = plt.subplots(figsize=(5, 3))
    axis.bar(["Holmes pp2 x dp2", "DDP dp4"], [holmes["tokens_per_s"], ddp["tokens_per_s"]], color=["C0", "C1"])
    axis.set_ylabel("tokens/s (median step)")
    axis.set_title(f"{CLUSTER} on loopback, 4 CPU processes")
    figure.tight_layout()
    figure.savefig(OUT / "holmes_vs_ddp.png", dpi=120)
    print(f"  wrote {OUT / 'holmes_vs_ddp.json'} and {OUT / 'holmes_vs_ddp.png'}")


if __name__ == "__main__":
    sys.exit(main())
