"""A lost node on one host: train.py's ranks stop, and the job restarts on the nodes left, re-planned, from the
newest checkpoint (`elastic.max_restarts`), or ends clearly below `elastic.min_nodes`."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanError, PlanOptions, best_plan
from holmes_lightning.planner.survivors import _fewer_nodes, plan_on_most_nodes
from holmes_lightning.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
GPT_TINY = ModelProfile.from_gpt(ModelConfig(name="gpt_tiny", n_layers=4, d_model=128, n_heads=4, seq_len=128))


def kill_rank_after_first_checkpoint(checkpoints: Path, rank: int, run_dir: Path, stop: threading.Event) -> None:
    """SIGKILL the process running `rank` of the job writing into `run_dir`, once a checkpoint is complete."""
    while not stop.is_set() and not any(checkpoints.glob("*/complete.json")):
        time.sleep(0.2)
    time.sleep(1.0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and str(run_dir).encode() in command:
            os.kill(int(pid), signal.SIGKILL)
            return


def train_and_kill(tmp_path: Path, rank: int, *overrides: str) -> subprocess.CompletedProcess:
    """train.py on `two_cluster_mixed` for 20 steps, a checkpoint every 5, `rank` killed after the first one."""
    checkpoints = tmp_path / "checkpoints"
    stop = threading.Event()
    killer = threading.Thread(target=kill_rank_after_first_checkpoint, args=(checkpoints, rank, tmp_path, stop))
    killer.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "train.py",
        "cluster=two_cluster_mixed",
        "trainer.max_steps=20",
        "checkpoint.every_n_steps=5",
        f"output_dir={tmp_path}",
        *overrides,
    ]
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        stop.set()
        killer.join()


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_on_the_nodes_left_from_the_newest_checkpoint(tmp_path):
    out = train_and_kill(tmp_path, 3, "elastic.max_restarts=1")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "holmes: rank 3 on node B-node1 was killed by SIGKILL" in log
    assert re.search(r"holmes: node B-node1 lost; restart 1 of 1 on 3 of the 3 nodes left \(3 ranks\)", log), log[
        -3000:
    ]
    resumed = re.search(r"train\.py: resuming from \S+step_0*(\d+)\.ckpt", log)
    assert resumed, log[-3000:]
    plans = re.findall(r"holmes plan: pp=(\d+) x dp=(\d+)", log)
    assert plans[0] == ("2", "2") and plans[-1][0] == "3" and plans[-1][1] == "1", plans  # the survivors' own plan
    (summary,) = re.findall(r"holmes: (\d+) steps, train loss", log)
    assert int(summary) == 20 - int(resumed[1])  # the rest of max_steps, after the step it resumed from


@pytest.mark.slow
def test_a_lost_node_below_min_nodes_ends_the_job_with_the_reason(tmp_path):
    out = train_and_kill(tmp_path, 3, "elastic.max_restarts=1", "elastic.min_nodes=4")
    assert out.returncode == 137, out.stderr[-3000:]
    assert "holmes: node B-node1 lost; 3 nodes left, below elastic.min_nodes=4: the job ends" in out.stderr


def test_survivors_that_cannot_all_hold_the_model_train_on_the_most_that_can():
    """three_cluster less one node: 7 single-GPU nodes, so only pp=7 uses them all, more stages than GPT-tiny's 6
    layers; one node sits out, one of the cluster whose loss costs least."""
    survivors = Topology.from_config("three_cluster").without(["B-node1"])
    batch = BatchSettings(global_batch=8)

    def plan(nodes: Topology):
        return best_plan(nodes, GPT_TINY, batch, options=PlanOptions(backend="gloo"))

    with pytest.raises(PlanError, match="pp=7 stages"):
        plan(survivors)
    nodes, chosen = plan_on_most_nodes(survivors, plan)
    assert len(nodes.nodes) == 6 and chosen.world_size == 6
    others = [survivors.without([n.name]) for n in survivors.nodes]  # every other node sitting out instead
    assert chosen.prediction.tokens_per_s >= max(
        plan(other).prediction.tokens_per_s for other in others if _plans(plan, other)
    )
    tiny = PlanOptions(backend="gloo", memory_limit_gb=1e-6)  # nothing fits: the refusal of all the nodes left
    with pytest.raises(PlanError, match="pp=7 stages"):
        plan_on_most_nodes(survivors, lambda nodes: best_plan(nodes, GPT_TINY, batch, options=tiny))


def _plans(plan, nodes: Topology) -> bool:
    try:
        plan(nodes)
    except PlanError:
        return False
    return True


def test_the_node_counts_to_try_come_fewest_sitting_out_first_and_as_needed():
    """Every way to keep fewer nodes, one node out before two, each once; 8 clusters of 512 nodes start at once."""
    sizes = (4, 1, 2)
    every = [kept for kept in itertools.product(*(range(n + 1) for n in sizes)) if 0 < sum(kept) < sum(sizes)]
    tried = list(_fewer_nodes(sizes))
    assert sorted(tried) == sorted(every) and len(set(tried)) == len(tried)
    assert [sum(sizes) - sum(kept) for kept in tried] == sorted(sum(sizes) - sum(kept) for kept in tried)
    assert len(list(itertools.islice(_fewer_nodes((512,) * 8), 199))) == 199
