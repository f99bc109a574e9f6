"""Faults while a job runs: a rank SIGKILLed or frozen mid-step, a rank killed inside the lab, SIGTERM to train.py.

Each case is a real job (gloo processes started by the launcher) and a real signal; nothing is mocked.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from distributed import TinyMLP, deadline, one_rank_fails_while_the_others_wait, run_ranks, tiny_loader

from holmes_lightning import HolmesStrategy
from holmes_lightning.lab import run_in_lab
from holmes_lightning.lab.design import run_prefix
from holmes_lightning.lab.network import list_namespaces, unavailable_reason
from holmes_lightning.runtime import checkpoint
from holmes_lightning.runtime.preemption import HolmesCheckpoint
from holmes_lightning.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
FAULT_STEP, HANG_TIMEOUT_S = 2, 5
NEVER_S = 3600  # a collective timeout no test waits for: only a closed connection or the launcher ends such a wait


class SignalMidStep(L.Callback):
    """On `rank`, a few milliseconds into step `step`, sends `signum` to this process."""

    def __init__(self, rank: int, step: int, signum: int) -> None:
        self.rank, self.step, self.signum = rank, step, signum

    def on_train_batch_start(self, trainer: L.Trainer, *_args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            threading.Timer(0.005, os.kill, (os.getpid(), self.signum)).start()


def train_until_a_fault(job_cluster: str, rank: int, signum: int, pid_dir: str, collective_timeout_s: float) -> None:
    """Rank side: note this process's pid, then train (pipelined) until `signum` hits `rank` mid-step."""
    Path(pid_dir, f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    L.seed_everything(0)
    strategy = HolmesStrategy(cluster=job_cluster, pp=2, global_batch=8, microbatches=2, timeout=collective_timeout_s)
    topology = Topology.from_config(job_cluster)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=len(topology.nodes[0].ranks),
        num_nodes=len(topology.nodes),
        strategy=strategy,
        max_steps=10_000,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SignalMidStep(rank, FAULT_STEP, signum), HolmesCheckpoint(Path(pid_dir, "ckpt"))],
    )
    trainer.fit(TinyMLP(), tiny_loader(10_000, 8 // (trainer.world_size // 2)))  # 8 samples over dp = ranks / 2


def _fault_run(capfd: pytest.CaptureFixture, tmp_path: Path, cluster: str, **kwargs: Any) -> tuple[str, list[int]]:
    """Run the faulty job (run_ranks fails it if it hangs); returns the launcher's stderr and the ranks' pids."""
    target = "test_reliability:train_until_a_fault"
    with pytest.raises(RuntimeError, match="failed on some rank") as failure:
        run_ranks(
            target, cluster=cluster, job_cluster=cluster, pid_dir=str(tmp_path), timeout_s=300, launcher=True, **kwargs
        )
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    return capfd.readouterr().err + str(failure.value), pids


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.mark.slow
def test_a_rank_killed_mid_step_stops_the_job_and_is_named(capfd: pytest.CaptureFixture, tmp_path: Path) -> None:
    """The peers' collectives would wait an hour: they end on the closed connections, or the launcher stops them."""
    err, pids = _fault_run(
        capfd, tmp_path, cluster="two_cluster_mixed", rank=2, signum=signal.SIGKILL, collective_timeout_s=NEVER_S
    )
    assert "holmes: rank 2 on node B-node0 was killed by SIGKILL; stopping the other ranks" in err
    assert "exit code 137" in err
    assert len(pids) == 4 and not any(_alive(pid) for pid in pids)


@pytest.mark.slow
def test_a_frozen_rank_makes_its_peers_time_out(capfd: pytest.CaptureFixture, tmp_path: Path) -> None:
    """SIGSTOP, like a node that hangs without closing its sockets: only the collective timeout ends the wait."""
    err, pids = _fault_run(
        capfd, tmp_path, cluster="single_node", rank=1, signum=signal.SIGSTOP, collective_timeout_s=HANG_TIMEOUT_S
    )
    assert re.search(r"holmes: rank 0 on node local-node0 exited with code 1", err)
    assert f"Timed out waiting {HANG_TIMEOUT_S * 1000}ms" in err  # gloo's error: the configured timeout ended it
    assert "holmes: ranks [1] ignored SIGTERM" in err  # a stopped process only dies by SIGKILL
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.lab
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"the lab needs root: {unavailable_reason()}")
def test_a_rank_killed_in_the_lab_leaves_no_namespace_or_process(capfd: pytest.CaptureFixture, tmp_path: Path) -> None:
    command = one_rank_fails_while_the_others_wait(1, "os.kill(os.getpid(), signal.SIGKILL)", tmp_path)
    with deadline(300, "a lab run whose ranks wait until they are stopped"):
        assert run_in_lab(Topology.from_config("two_cluster_mixed"), command, bandwidth_scale=0.01).code == 137
    out, err = capfd.readouterr()
    assert "holmes: rank 1 on node A-node1 was killed by SIGKILL" in err
    assert sorted(re.findall(r"rank (\d) stopped by SIGTERM", err)) == ["0", "2", "3"]
    assert [name for name in list_namespaces() if name.startswith(run_prefix(os.getpid()))] == []
    survivors = [int(line) for line in out.splitlines() if line.strip().isdigit()]
    assert len(survivors) == 3 and not any(_alive(pid) for pid in survivors)


TINY_JOB = (
    "cluster=single_node",
    "strategy.pp=2",
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "data.global_batch=8",
    "data.corpus_bytes=300000",
    "trainer.val_check_interval=null",
    "checkpoint.every_n_steps=5",
    "checkpoint.keep=2",
)


def _train(output_dir: Path, max_steps: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "train.py", *TINY_JOB, f"trainer.max_steps={max_steps}", f"output_dir={output_dir}", *args]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_to_train_py_checkpoints_and_resume_auto_continues(tmp_path: Path) -> None:
    job = _train(tmp_path, max_steps=10_000)  # the job cannot end before the signal, however fast the machine
    first = tmp_path / "checkpoints" / "step_000005.ckpt"
    deadline = time.monotonic() + 300
    while not first.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)  # to the launcher, as SLURM does; it forwards SIGTERM to every rank
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-3000:]
    stopped = re.search(r"holmes: stop requested \(SIGTERM\); step (\d+) is checkpointed", out + err)
    assert stopped, (out + err)[-3000:]
    step = int(stopped.group(1))
    assert step >= 5
    assert checkpoint.latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / f"step_{step:06d}.ckpt"

    end = (step // 5 + 1) * 5  # the next periodic checkpoint
    resumed = _train(tmp_path, end, "resume=auto")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{step:06d}.ckpt'}" in out
    assert "holmes: running the plan stored with checkpoint" in out + err  # same nodes and settings: same plan
    assert re.search(rf"holmes: {end - step} steps, train loss", out), out[-3000:]
    assert checkpoint.latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / f"step_{end:06d}.ckpt"
