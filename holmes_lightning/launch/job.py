"""What a job learns from whoever started it (our launcher, torchrun, SLURM): its name, its timeouts, its time left.

Pure functions of the environment variables, so each decision is tested without a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime

from omegaconf import OmegaConf

from holmes_lightning.launch.processes import LAUNCHED_ENV
from holmes_lightning.planner import Backend

SCALE_TIMEOUT_S = 1800.0  # torch's default: NCCL builds communicators at the first collective, slow on many nodes
LOCAL_TIMEOUT_S = 120.0  # ranks our launcher starts on one machine (loopback, lab): a hang should end soon


RESTART_ENV = "HOLMES_RESTART"  # set by holmes-launch's elastic loop: how many times it restarted the job


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times the launcher restarted this job after a lost node: holmes-launch's elastic loop, or torchrun's
    agent (`TORCHELASTIC_RESTART_COUNT`); 0 for the first start."""
    return int(environ.get(RESTART_ENV) or environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def run_name(environ: Mapping[str, str], now: datetime) -> str:
    """The run directory's name, the same on every rank of one job (each rank resolves it for itself).

    SLURM's job id (array jobs: `<array job>_<task>`), else torchrun's rendezvous id (`--rdzv-id`, or the id
    `--standalone` makes up), else the address and port every rank was told to meet at; a process that is no rank
    (the launcher) names the run by its start time.
    """
    if "SLURM_JOB_ID" in environ:
        array_task = environ.get("SLURM_ARRAY_TASK_ID")
        job = f"{environ['SLURM_ARRAY_JOB_ID']}_{array_task}" if array_task else environ["SLURM_JOB_ID"]
        return f"slurm-{job}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id}"
    if "MASTER_ADDR" in environ and "MASTER_PORT" in environ and "RANK" in environ:
        return f"job-{environ['MASTER_ADDR']}-{environ['MASTER_PORT']}"
    return now.strftime("%Y-%m-%d_%H-%M-%S")


def register_run_name_resolver() -> None:
    """`${holmes_run_name:}` in a config (conf/config.yaml's hydra.run.dir): this process's `run_name`."""
    OmegaConf.register_new_resolver(
        "holmes_run_name", lambda: run_name(os.environ, datetime.now()), use_cache=True, replace=True
    )


def collective_timeout_s(configured: float | None, environ: Mapping[str, str]) -> float:
    """`configured`, or by default: short for ranks our launcher started on this machine, torch's 30 min otherwise."""
    if configured is not None:
        return configured
    return LOCAL_TIMEOUT_S if LAUNCHED_ENV in environ else SCALE_TIMEOUT_S


def timeout_warning(timeout_s: float, backend: Backend, nodes: int) -> str | None:
    """A warning when an NCCL job on several nodes may fail only because its first collectives wait too little."""
    if backend != Backend.nccl or nodes < 2 or timeout_s >= SCALE_TIMEOUT_S:
        return None
    return (
        f"strategy.timeout_s={timeout_s:g}: NCCL builds each communicator at its first collective, which can take "
        f"minutes on {nodes} nodes; below {SCALE_TIMEOUT_S:g} s (torch's default) the job may time out at start. "
        f"Set strategy.timeout_s=null (default) unless a hang must end sooner"
    )


def seconds_until_kill(environ: Mapping[str, str], now: float, grace_s: float | None) -> float | None:
    """Seconds left before the scheduler kills the job: SLURM's end time (`SLURM_JOB_END_TIME`, Unix seconds) or the
    grace the user stated for a stop signal, the smaller; None when neither is known."""
    known = [] if grace_s is None else [grace_s]
    end = environ.get("SLURM_JOB_END_TIME", "")
    if end.isdigit():
        known.append(int(end) - now)
    return min(known) if known else None


def stop_outlook(seconds_left: float | None, step_s: float | None, save_s: float | None) -> str | None:
    """A warning when the step in flight plus saving its checkpoint is predicted to outlast the time left."""
    if seconds_left is None or step_s is None:
        return None
    needed = step_s + (save_s or 0.0)
    if needed <= seconds_left:
        return None
    saving = f" + {save_s:.0f} s to save" if save_s else ""
    return (
        f"the stop signal leaves {max(seconds_left, 0.0):.0f} s before the kill, but a step takes {step_s:.0f} s"
        f"{saving}: the checkpoint at the next step boundary will not make it. Ask for the signal earlier "
        f"(#SBATCH --signal=B:TERM@{int(needed * 1.5) + 60}, torchrun --shutdown-timeout)"
    )
