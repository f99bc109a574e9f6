"""What a job reads from its launcher's environment: one run directory per job, timeouts, time left before a kill."""

from __future__ import annotations

from datetime import datetime

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from holmes_lightning.cli.config import StrategyConfig, register_configs
from holmes_lightning.launch import job
from holmes_lightning.topology import config_dir

NOW = datetime(2025, 1, 2, 3, 4, 5)
TORCHRUN_RANK = {"RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}


@pytest.mark.parametrize(
    ("environ", "name"),
    [
        ({"SLURM_JOB_ID": "4711", "SLURM_PROCID": "5"}, "slurm-4711"),
        ({"SLURM_JOB_ID": "4712", "SLURM_ARRAY_JOB_ID": "4700", "SLURM_ARRAY_TASK_ID": "12"}, "slurm-4700_12"),
        ({**TORCHRUN_RANK, "TORCHELASTIC_RUN_ID": "llm-7b"}, "torchrun-llm-7b"),
        (TORCHRUN_RANK, "job-10.0.0.1-29500"),  # torchrun's default --rdzv-id is "none": the meeting point names it
    ],
)
def test_every_rank_of_a_job_names_the_same_run_directory(environ: dict[str, str], name: str) -> None:
    assert job.run_name(environ, NOW) == name
    assert job.run_name(environ, NOW.replace(second=59)) == name  # ranks start at different moments


def test_a_process_outside_a_job_names_the_run_by_its_start_time() -> None:
    assert job.run_name({}, NOW) == "2025-01-02_03-04-05"


def test_the_train_config_puts_every_rank_of_a_slurm_job_in_one_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    register_configs()
    job.register_run_name_resolver()
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        config = compose("config", overrides=["output_dir=/runs"], return_hydra_config=True)
    assert OmegaConf.select(config, "hydra.run.dir") == "/runs/slurm-4711"


def test_the_default_timeout_is_short_on_this_machine_and_torchs_under_other_launchers() -> None:
    default = StrategyConfig().timeout_s  # what train.py passes unless strategy.timeout_s is set
    assert job.collective_timeout_s(default, {job.LAUNCHED_ENV: "1"}) == 120
    assert job.collective_timeout_s(default, {"TORCHELASTIC_RUN_ID": "x"}) == 1800
    assert job.collective_timeout_s(default, {"SLURM_JOB_ID": "1"}) == 1800
    assert job.collective_timeout_s(45, {"SLURM_JOB_ID": "1"}) == 45


def test_a_short_timeout_is_warned_about_only_for_nccl_on_several_nodes() -> None:
    assert "strategy.timeout_s=120" in job.timeout_warning(120, "nccl", nodes=8)
    assert job.timeout_warning(120, "nccl", nodes=1) is None
    assert job.timeout_warning(120, "gloo", nodes=8) is None
    assert job.timeout_warning(1800, "nccl", nodes=8) is None


def test_time_left_is_slurms_end_time_or_the_stated_grace_whichever_is_sooner() -> None:
    assert job.seconds_until_kill({}, now=1000.0, grace_s=None) is None
    assert job.seconds_until_kill({}, now=1000.0, grace_s=30) == 30
    assert job.seconds_until_kill({"SLURM_JOB_END_TIME": "1300"}, now=1000.0, grace_s=None) == 300
    assert job.seconds_until_kill({"SLURM_JOB_END_TIME": "1300"}, now=1000.0, grace_s=30) == 30
    assert job.seconds_until_kill({"SLURM_JOB_END_TIME": "Unknown"}, now=1000.0, grace_s=None) is None


def test_a_step_that_outlasts_the_time_left_is_announced() -> None:
    warning = job.stop_outlook(seconds_left=90, step_s=70, save_s=40)
    assert "leaves 90 s before the kill, but a step takes 70 s + 40 s to save" in warning
    assert "will not make it" in warning and "--signal=B:TERM@" in warning
    assert job.stop_outlook(seconds_left=120, step_s=70, save_s=40) is None
    assert job.stop_outlook(seconds_left=None, step_s=70, save_s=40) is None  # nothing known: nothing claimed
    assert job.stop_outlook(seconds_left=60, step_s=None, save_s=None) is None
