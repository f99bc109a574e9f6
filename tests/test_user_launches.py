"""A user's script (tests/user_script.py, not from recipes/) trains to one process's losses under every launcher.

Lightning's own launcher (`python user_script.py`, devices=4), `torchrun --standalone --nproc-per-node 4` (with
`strategy="holmes"`) and `holmes-launch cluster=two_cluster_mixed`: the same file, as pp=2 x dp=2 over the two
clusters' emulated nodes. The reference trains the same model in this process on the whole global batch per step, in
the order Lightning's DistributedSampler gives the two replicas together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import lightning as L
import pytest
import user_script
from torch.utils.data import DataLoader, DistributedSampler

SCRIPT = str(Path(user_script.__file__).resolve())
EMULATION_LINE = "HolmesStrategy: 4 processes on this host play the 4 nodes of cluster 'two_cluster_mixed'"
LAUNCHERS = {
    "lightning": [sys.executable, SCRIPT],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", SCRIPT],
    "holmes-launch": [sys.executable, "-m", "holmes_lightning.cli.launch", "cluster=two_cluster_mixed", "--"]
    + [sys.executable, SCRIPT],
}


@cache
def launched(name: str, out: str) -> tuple[list[list[float]], str]:
    """Every rank's per-step losses and the job's output, for one launcher."""
    done = subprocess.run([*LAUNCHERS[name], out], capture_output=True, text=True, timeout=600, cwd=out, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(4)], output


@cache
def reference_losses(global_batch: int = user_script.GLOBAL_BATCH) -> list[float]:
    L.seed_everything(user_script.SEED)
    model, losses = user_script.GatedClassifier(), user_script.StepLosses()
    data = user_script.dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=user_script.SEED)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=user_script.STEPS,
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=global_batch, sampler=sampler))
    return losses.losses


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["lightning", "holmes-launch"])  # torchrun: the next test
def test_user_script_matches_one_process(launcher, tmp_path_factory):
    per_rank, output = launched(launcher, str(tmp_path_factory.mktemp(launcher)))
    expected = reference_losses()
    assert len(expected) == user_script.STEPS
    for losses in per_rank:
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # one host plays every node: said once (rank 0) when the launcher numbered ranks on one node
    assert output.count(EMULATION_LINE) == (0 if launcher == "holmes-launch" else 1), output[-5000:]


@pytest.mark.slow
def test_strategy_holmes_takes_the_batch_size_of_a_ddp_style_dataloader(tmp_path):
    """`Trainer(strategy="holmes")` with no global batch and no example_input_array, under torchrun: each DP replica
    reads one batch of the DataLoader's size per step, so the step is one process's on that batch x the planned dp."""
    command = [*LAUNCHERS["torchrun"], str(tmp_path), "registered"]
    environment = {**os.environ, "HOLMES_CLUSTER": "two_cluster_mixed"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=environment)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    written = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    dp = written[0]["dp"]
    assert f"global batch {user_script.LOADER_BATCH * dp}: the DataLoader's batch_size=" in output
    expected = reference_losses(user_script.LOADER_BATCH * dp)
    for rank in written:
        assert rank["dp"] == dp and rank["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert output.count(EMULATION_LINE) == 1, output[-5000:]
