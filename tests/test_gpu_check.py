"""The GPU check's parts that run without a GPU: the script, its decisions (NCCL's net from its log, losses, the memory
tolerance, what proves the forced path ran), and the whole check on gloo CPU processes."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from holmes_lightning.cli import gpu_check
from holmes_lightning.cli.gpu_check import Job, Outcome
from holmes_lightning.measure import peak_resident_bytes, restart_peak_resident

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
CHECKS = ["environment", "calibration", "nccl_net", "train", "activation_checkpointing", "memory_estimate", "multi_gpu"]

SOCKET_LOG = """\
node-a:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.7<0>
node-a:4242:4242 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
node-a:4242:4260 [0] NCCL INFO NET/IB : No device found.
node-a:4242:4260 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.7<0>
node-a:4242:4260 [0] NCCL INFO Using network Socket
node-a:4242:4260 [0] NCCL INFO ncclCommInitRank comm 0x55d0 rank 0 nranks 1 cudaDev 0 - Init COMPLETE
"""
IB_LOG = """\
node-b:77:90 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB ib0:10.1.0.3<0>
node-b:77:90 [0] NCCL INFO Using network IB
[rank0]:[W1204 10:00:00.000] a warning of torch's in between
node-b:77:95 [0] NCCL INFO Using network IB
"""


def job(tmp_path: Path, report: dict[str, Any] | None, log: str = "", name: str = "uninterrupted") -> Job:
    path = tmp_path / f"{name}.log"
    path.write_text(log)
    return Job(name, report, None if report is not None else "exit code 1", path)


def train_report(**changes: Any) -> dict[str, Any]:
    """What rank 0 of a one-process training job reports when the forced path ran as it should."""
    report = {
        "pp": 1,
        "dp": 1,
        "sharding": "fsdp",
        "virtual_stages": 2,
        "local_stages": 2,
        "schedule": "ScheduleInterleaved1F1B",
        "fsdp_modules": 6,
        "dtensor_params": True,
        "forward_dtypes": ["torch.bfloat16"],
        "norms_before": [1.5, 2.2],
        "norms_after": [0.1, 0.1],
        "checkpoints": ["step=3.ckpt"],
        "losses": [5.5, 5.2, 4.8, 4.6, 4.5],
        "val_loss": 4.4,
        "step_s": [1.0, 0.5, 0.5],
        "peak_gb": 0.07,
        "memory_gb": 0.072,
        "checkpointing": "off",
        "backend": "gloo",
    }
    return {**report, **changes}


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_script_installs_what_pyproject_requires_and_never_torch() -> None:
    script = SCRIPT.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    installed = re.findall(r'^\s+"\w+": "([^"]+)",$', script, re.MULTILINE)
    assert installed == ["lightning>=2.4,<2.7", "torchmetrics>=1.0", "hydra-core>=1.3", "omegaconf>=2.3"]
    assert all(f'"{requirement}"' in pyproject for requirement in installed)
    assert '--constraint "$constraints"' in script  # the installed torch pinned while pip installs the others


def test_the_gpu_model_has_the_widths_of_gpt_7_5b() -> None:
    paper = yaml.safe_load((ROOT / "conf" / "model" / "gpt_7_5b.yaml").read_text())
    model = gpu_check.WORKLOADS["cuda"].model
    widths = ("d_model", "n_heads", "seq_len", "vocab_size")
    assert {key: getattr(model, key) for key in widths} == {key: paper[key] for key in widths}
    assert model.n_layers < paper["n_layers"]


@pytest.mark.parametrize(
    ("log", "nets", "details"),
    [
        (SOCKET_LOG, ["Socket"], ["NET/Socket : Using [0]eth0:10.0.0.7<0>"]),
        (IB_LOG, ["IB"], ["NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB ib0:10.1.0.3<0>"]),
        ("host:1:1 [0] NCCL INFO Using network AWS Libfabric\n", ["AWS Libfabric"], []),
        ("no NCCL here\n", [], []),
    ],
)
def test_the_net_nccl_selected_is_read_from_its_log(log: str, nets: list[str], details: list[str]) -> None:
    assert gpu_check.selected_nets(log) == nets
    assert [line for net in nets for line in gpu_check.net_details(log, net)] == details


def test_nccl_net_reports_the_net_or_fails_without_nccl_s_log(tmp_path: Path) -> None:
    found = gpu_check.nccl_net_outcome(job(tmp_path, train_report(), IB_LOG), "cuda")
    assert found.line() == (
        "gpu_check: nccl_net: ok (NET/IB; NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB ib0:10.1.0.3<0>)"
    )
    silent = gpu_check.nccl_net_outcome(job(tmp_path, train_report(), "no NCCL here\n"), "cuda")
    assert silent.failed and "no 'NCCL INFO Using network' line" in silent.line()
    crashed = gpu_check.nccl_net_outcome(job(tmp_path, None), "cuda")
    assert crashed.line().startswith("gpu_check: nccl_net: FAILED: the uninterrupted run: exit code 1")


def test_losses_must_match_within_the_tolerance() -> None:
    assert gpu_check.loss_mismatch([5.0, 4.0], [5.01, 4.05], rtol=2e-2) is None
    assert gpu_check.loss_mismatch([5.0, 4.0], [5.0, 4.2], rtol=2e-2) == "loss 1: 4.2, expected 4 (rtol 0.02)"
    assert gpu_check.loss_mismatch([5.0, 4.0], [5.0, float("nan")], rtol=2e-2).startswith("loss 1: nan")
    assert gpu_check.loss_mismatch([5.0, 4.0], [5.0], rtol=2e-2) == "1 losses, expected 2"
    assert gpu_check.loss_mismatch([4.0], [4.0 * (1 + 2e-6)], rtol=gpu_check.SAME_RUN_RTOL["cpu"]) is not None


def test_a_resumed_run_must_continue_the_uninterrupted_one(tmp_path: Path) -> None:
    base = job(tmp_path, train_report())
    same = job(tmp_path, train_report(losses=[4.6, 4.5], checkpoints=[]), name="resumed")
    assert not gpu_check.train_outcome(base, same, "cpu").failed
    other = job(tmp_path, train_report(losses=[4.6, 4.7], checkpoints=[]), name="resumed")
    assert gpu_check.train_outcome(base, other, "cpu").problem == "loss 1: 4.7, expected 4.5 (rtol 1e-06)"


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"dp": 2}, "dp=2 (wanted 1)"),
        ({"fsdp_modules": 0, "dtensor_params": False}, "fsdp_modules=0 (wanted 6), dtensor_params=False (wanted True)"),
        ({"forward_dtypes": ["torch.float32"]}, "forward_dtypes=['torch.float32'] (wanted ['torch.bfloat16'])"),
        ({"local_stages": 1}, "local_stages=1 (wanted 2)"),
    ],
)
def test_the_forced_path_must_show_in_the_report(changes: dict[str, Any], problem: str) -> None:
    assert gpu_check.structure_problem(train_report(), layers=6) is None
    assert gpu_check.structure_problem(train_report(**changes), layers=6) == problem


def test_clipping_must_have_engaged_and_held() -> None:
    assert gpu_check.clipping_problem(train_report()) is None
    assert "after clipping" in gpu_check.clipping_problem(train_report(norms_after=[0.1, 0.2]))
    assert "clipping untested" in gpu_check.clipping_problem(train_report(norms_before=[0.05, 0.08]))


@pytest.mark.parametrize(
    ("measured", "estimate", "within"),
    [(1.0, 1.0, True), (1.4, 1.0, True), (0.7, 1.0, True), (1.6, 1.0, False), (0.6, 1.0, False), (1.0, 0.0, False)],
)
def test_measured_memory_must_be_near_the_plan_s_estimate(measured: float, estimate: float, within: bool) -> None:
    assert (gpu_check.memory_problem(measured, estimate) is None) == within
    assert gpu_check.memory_problem(1.6, 1.0) == "measured 1.6 GB, the plan estimates 1 GB: 1.60x, outside 0.67-1.5x"


def test_the_cpu_peak_counts_from_where_training_starts() -> None:
    """On CPU a run's peak is the process's resident memory from its train start: what came before is forgotten."""
    before_training = bytearray(b"x") * (256 * 2**20)  # every page written: resident
    del before_training
    earlier = peak_resident_bytes()
    assert restart_peak_resident()
    assert peak_resident_bytes() < earlier - 200 * 2**20


def test_checkpointing_must_lower_the_peak_and_keep_the_losses(tmp_path: Path) -> None:
    base = job(tmp_path, train_report())
    lower = job(tmp_path, train_report(checkpointing="full", peak_gb=0.05), name="checkpointed")
    assert not gpu_check.checkpointing_outcome(base, lower, "cpu").failed
    higher = job(tmp_path, train_report(checkpointing="full", peak_gb=0.08), name="checkpointed")
    assert gpu_check.checkpointing_outcome(base, higher, "cpu").problem == "peak 0.08 GB, not below 0.07"


def test_lines_say_ok_failed_or_which_gpus_a_check_needs() -> None:
    assert Outcome("train", detail="fine").line() == "gpu_check: train: ok (fine)"
    assert Outcome("train", "broken").line() == "gpu_check: train: FAILED: broken"
    assert Outcome("multi_gpu", needs_gpus=2).line() == "gpu_check: multi_gpu: skipped (needs 2 GPUs)"


@pytest.mark.parametrize(("requested", "processes"), [(None, 2), (1, None), (3, 2), (5, 4), (16, 8)])
def test_the_multi_process_run_takes_pairs_of_devices(requested: int | None, processes: int | None) -> None:
    assert gpu_check.multi_gpu_processes("cpu", requested) == processes


@pytest.mark.skipif(gpu_check.torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_without_a_gpu_the_check_fails_with_one_line(capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main([]) == 1
    (output,) = capsys.readouterr().out.splitlines()
    assert output.startswith("gpu_check: environment: FAILED: ")


@pytest.mark.slow
def test_the_script_runs_every_check_on_cpu_processes() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPU_CHECK_INSTALL": "0"}
    started = time.monotonic()
    done = subprocess.run([str(SCRIPT), "--device", "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [text.split(":")[1].strip() for text in lines] == CHECKS
    assert all(": ok (" in text for text in lines[:-1])
    assert lines[-1].startswith(("gpu_check: multi_gpu: ok (pp=2 x dp=1", "gpu_check: multi_gpu: skipped"))
    assert "pp=1 x dp=1, 2 virtual stages (ScheduleInterleaved1F1B), FSDP2+MP on 6 layers" in lines[3]
    print(f"the CPU check took {time.monotonic() - started:.0f} s")
