"""`python3 -m holmes_lightning.cli.gpu_check`: does HolmesStrategy train on this machine's GPUs, over NCCL, in bf16?

Checks, one line each, exit code 1 if any fails:
  1. the environment: torch's CUDA and NCCL, the GPUs, bf16 support;
  2. one process, pp=1, FSDP2 over a one-rank NCCL mesh: a few real bf16 training steps, finite losses;
  3. with two GPUs or more, every GPU: pp=2 x dp=N/2 (pp=N for an odd N), the same steps on the same data, losses
     equal to the one-process run's (bf16 tolerance).
Each run is a fresh `torchrun --standalone` job (not our launcher, as a user would start it), with a small model
defined here. `--device cpu` runs the same checks on gloo with CPU processes (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from holmes_lightning.runtime import HolmesStrategy

SEED, VOCAB, SEQ, STEPS = 7, 256, 64, 4
BATCH_PER_REPLICA, MICROBATCHES = 8, 4
LOSS_RTOL = 2e-2  # bf16 compute, and micro-batches summed in another order than the full batch
RUN_TIMEOUT_S = 600


class CheckModel(L.LightningModule):
    """A small decoder as pipeline layers: token embedding, pre-norm transformer layers, norm + vocabulary head."""

    def __init__(self, d_model: int = 256, n_heads: int = 4, n_layers: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers)
        )
        self.head = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB))
        self.example_input_array = torch.zeros(1, SEQ, dtype=torch.long)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embedding, *self.blocks, self.head]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            tokens = layer(tokens)
        return tokens

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepLosses(L.Callback):
    """The loss of each training step, as Lightning receives it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def layout_for(processes: int) -> tuple[int, int]:
    """(pp, dp) for `processes` ranks on one machine: two stages when they split evenly, else one rank per stage."""
    if processes == 1:
        return 1, 1
    return (2, processes // 2) if processes % 2 == 0 else (processes, 1)


def loss_mismatch(reference: Sequence[float], measured: Sequence[float], rtol: float = LOSS_RTOL) -> str | None:
    """Why `measured` step losses are not `reference`'s (None when they agree within `rtol`)."""
    if len(measured) != len(reference):
        return f"{len(measured)} step losses, expected {len(reference)}"
    for step, (want, got) in enumerate(zip(reference, measured, strict=True)):
        if not math.isfinite(got) or abs(got - want) > rtol * abs(want):
            return f"step {step}: loss {got:.5f}, one process gave {want:.5f} (rtol {rtol:g})"
    return None


def line(check: str, problem: str | None, detail: str = "") -> str:
    """`gpu_check: CHECK: ok (DETAIL)` or `gpu_check: CHECK: FAILED: PROBLEM`."""
    return f"gpu_check: {check}: " + (f"FAILED: {problem}" if problem else f"ok ({detail})")


def environment_problem(device: str) -> tuple[str | None, str]:
    """(what stops a GPU check here, or None; what was found)."""
    if device == "cpu":
        return None, f"torch {torch.__version__}, CPU processes on gloo"
    if torch.version.cuda is None:
        return "this torch has no CUDA (a CPU build); install a CUDA build of torch", f"torch {torch.__version__}"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (
            "torch finds no GPU (driver, CUDA_VISIBLE_DEVICES?)",
            f"torch {torch.__version__} cuda {torch.version.cuda}",
        )
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    found = (
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
        f"{torch.cuda.device_count()} x {', '.join(names)}"
    )
    if not torch.cuda.is_bf16_supported():
        return "these GPUs have no bf16 (HolmesStrategy pipelines train in bf16 or fp32)", found
    return None, found


def run_job(device: str, processes: int, workdir: Path) -> tuple[str | None, dict[str, Any]]:
    """Train as a `torchrun --standalone` job of `processes` ranks; (its problem or None, rank 0's report)."""
    report, log = workdir / f"report_{processes}.json", workdir / f"ranks_{processes}.log"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "holmes_lightning.cli.gpu_check",
        "--worker",
        f"--device={device}",
        f"--report={report}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as output:
        try:
            code = subprocess.run(command, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"no result after {RUN_TIMEOUT_S} s (a hang?); its output: {log}", {}
    if code.returncode != 0 or not report.is_file():
        return f"exit code {code.returncode}; its output: {log}", {}
    return None, json.loads(report.read_text())


def train_worker(device: str, report: Path) -> None:
    """One rank of a check job: a few bf16 steps under HolmesStrategy, losses written by rank 0."""
    processes = int(os.environ["WORLD_SIZE"])
    pp, dp = layout_for(processes)
    L.seed_everything(SEED)
    model = CheckModel()
    global_batch = BATCH_PER_REPLICA * dp
    starts = torch.randint(0, VOCAB, (STEPS * global_batch, 1))
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB  # counting sequences: learnable, so the loss falls
    cluster = {
        "name": "gpu_check",
        "devices_per_node": processes,
        "clusters": [{"name": "local", "nodes": 1, "nic": {"kind": None}}],
    }
    strategy = HolmesStrategy(
        cluster=cluster,
        pp=pp,
        dp=dp,
        sharding="fsdp",
        global_batch=global_batch,
        microbatches=MICROBATCHES if pp > 1 else None,  # one pass per step without a pipeline
    )
    losses = StepLosses()
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=processes,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    trainer.fit(model, DataLoader(data, batch_size=global_batch // dp, drop_last=True))
    if trainer.global_rank == 0:
        plan = strategy.plan
        assert plan is not None
        summary = {"losses": losses.losses, "layout": f"pp={plan.pp} x dp={plan.dp}, {plan.sharding}"}
        report.write_text(json.dumps({**summary, "backend": strategy.process_group_backend}))


def run_checks(device: str, processes: int | None) -> int:
    """Every check, one line each; 0 if all passed."""
    problem, found = environment_problem(device)
    print(line("environment", problem, found), flush=True)
    if problem:
        return 1
    gpus = torch.cuda.device_count() if device == "cuda" else None
    processes = processes or gpus or 2  # CPU: two processes unless asked
    if gpus is not None and processes > gpus:
        print(line(f"{processes} processes", f"only {gpus} GPUs here"), flush=True)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="holmes_gpu_check_"))  # the ranks' output; kept if a check fails
    problem, single = run_job(device, 1, workdir)
    reference = single.get("losses", [])
    if problem is None and not (reference and all(map(math.isfinite, reference))):
        problem = f"losses {reference}"
    detail = f"{single.get('layout')} on {single.get('backend')}, bf16, losses {[round(v, 4) for v in reference]}"
    print(line("1 process", problem, detail), flush=True)
    failed = problem is not None
    if processes > 1:
        problem, job = run_job(device, processes, workdir)
        problem = problem or loss_mismatch(reference, job["losses"])
        if problem is None:
            gap = max(abs(a - b) / abs(a) for a, b in zip(reference, job["losses"], strict=True))
            detail = f"{job['layout']} on {job['backend']}, losses within {gap:.1e} of 1 process's"
        print(line(f"{processes} processes", problem, detail), flush=True)
        failed = failed or problem is not None
    if not failed:
        shutil.rmtree(workdir)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m holmes_lightning.cli.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same checks on gloo")
    parser.add_argument("--processes", type=int, default=None, help="ranks of the last check (default: every GPU)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        train_worker(args.device, args.report)
        return 0
    return run_checks(args.device, args.processes)


if __name__ == "__main__":
    sys.exit(main())
