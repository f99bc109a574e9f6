"""A lost node: train.py's ranks stop, and the job restarts on the nodes left, re-planned, from the newest checkpoint
(`elastic.max_restarts` on one host, torchrun's elastic agent on many), or ends clearly below `elastic.min_nodes`."""

from __future__ import annotations

import csv
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
from holmes_lightning.launch.processes import free_port, kill_rank
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
    kill_rank(rank, str(run_dir))


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


def losses(run_dir: Path, start: str = "") -> dict[int, float]:
    """Training loss per step from the CSV log of one start of the job (`restart-N`: after the N-th restart)."""
    (metrics,) = run_dir.glob(f"*/csv/{start}/metrics.csv" if start else "*/csv/metrics.csv")
    return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(metrics.open()) if row["train_loss"]}


SMALLER = """defaults:
  - base_cluster
  - _self_
name: two_cluster_mixed_less_one
devices_per_node: 1
intra_node: {gbps: 2400}
inter_cluster: {gbps: 100}
clusters:
  - {name: A, nodes: 2, nic: {kind: infiniband, gbps: 200}}
  - {name: B, nodes: 1, nic: {kind: roce, gbps: 200}}
"""


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_on_the_nodes_left_from_the_newest_checkpoint(tmp_path):
    """... and trains on as a run started by hand from that checkpoint on a config of the nodes left does."""
    out = train_and_kill(tmp_path / "auto", 3, "elastic.max_restarts=1", "trainer.log_every_n_steps=1")
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
    (tmp_path / "conf" / "cluster").mkdir(parents=True)
    (tmp_path / "conf" / "cluster" / "smaller.yaml").write_text(SMALLER)
    by_hand = subprocess.run(
        [sys.executable, "train.py", "--config-dir", str(tmp_path / "conf"), "cluster=smaller", "trainer.max_steps=20"]
        + ["trainer.log_every_n_steps=1", f"resume={resumed[0].split()[-1]}", f"output_dir={tmp_path / 'by_hand'}"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    after = losses(tmp_path / "auto", "restart-1")
    assert len(after) == 20 - int(resumed[1]) and after == pytest.approx(losses(tmp_path / "by_hand"), rel=1e-5)
    assert set(range(int(resumed[1]))) <= set(losses(tmp_path / "auto"))  # the log before the restart stays


@pytest.mark.slow
def test_a_lost_node_below_min_nodes_ends_the_job_with_the_reason(tmp_path):
    out = train_and_kill(tmp_path, 3, "elastic.max_restarts=1", "elastic.min_nodes=4")
    assert out.returncode == 137, out.stderr[-3000:]
    assert "holmes: node B-node1 lost; 3 nodes left, below elastic.min_nodes=4: the job ends" in out.stderr


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a torchrun agent and its workers: the whole node gone."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if int(parent) == agent.pid:
            os.kill(int(pid), signal.SIGKILL)
    agent.kill()


@pytest.mark.slow
def test_torchrun_s_elastic_agent_restarts_the_job_on_the_nodes_left(tmp_path):
    """Three nodes of `two_cluster_mixed` join `torchrun --nnodes=2:3` (one host, one agent per node); one node dies
    after the first checkpoint: the two agents left meet again, the ranks plan for the 2 nodes present and resume."""
    endpoint = f"127.0.0.1:{free_port()}"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1"]
    agent += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=elastic-test"]
    agent += ["--rdzv-conf=last_call_timeout=2", "--max-restarts=1", "train.py", "cluster=two_cluster_mixed"]
    agent += ["elastic.min_nodes=2", "trainer.max_steps=20", "checkpoint.every_n_steps=5", "resume=auto"]
    agent += [f"output_dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    logs = [(tmp_path / f"agent{i}.log").open("w") for i in range(3)]
    agents = []
    for i, log in enumerate(logs):  # the first agent hosts the rendezvous: it starts first and stays
        agents.append(subprocess.Popen(agent, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        time.sleep(1.0 if i == 0 else 0.0)
    try:
        deadline = time.monotonic() + 300
        while not any(tmp_path.glob("checkpoints/*/complete.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        kill_node(agents[2])
        codes = [a.wait(timeout=300) for a in agents[:2]]
    finally:
        for a in agents:
            a.kill()
        for log in logs:
            log.close()
    out = "".join((tmp_path / f"agent{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], out[-3000:]
    assert "HolmesStrategy: 3 of the 4 nodes of cluster 'two_cluster_mixed' joined; missing: B-node1" in out
    assert "HolmesStrategy: 2 of the 4 nodes of cluster 'two_cluster_mixed' joined; missing: B-node0, B-node1" in out
    resumed = re.search(r"holmes: a new plan, not the plan stored with checkpoint \S+step_0*(\d+)\.ckpt", out)
    assert resumed, out[-3000:]
    assert re.search(r"holmes plan: pp=1 x dp=2", out), out[-3000:]  # two nodes of one cluster: data parallel
    assert re.findall(r"holmes: (\d+) steps, train loss", out)[-1] == str(20 - int(resumed[1]))


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
