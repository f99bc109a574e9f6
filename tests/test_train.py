import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_lab import needs_lab

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(
    r"holmes: (\d+) steps, train loss ([\d.]+) -> ([\d.]+) \| ([\d,]+) tokens/s \(predicted ([\d,]+): measured / "
    r"predicted [\d.]+\) without validation and checkpoint saves \| model ([\d.]+) TFLOPS .* \| MFU \d+% of the "
    r"calibrated peak"
)
DEPRECATION = re.compile(r"^.*(?:deprecat|FutureWarning).*$", re.IGNORECASE | re.MULTILINE)  # e.g. _pytree LeafSpec


def run_train(*args: str, command: tuple[str, ...] = ("train.py",), timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, *command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("override", "code", "message"),
    [
        ("model.n_layerz=3", 2, "Key 'n_layerz' not in 'ModelConfig'"),
        ("model.n_heads=3", 2, "model.d_model=128: must be a multiple of model.n_heads=3"),
    ],
)
def test_bad_config_exits_cleanly_before_any_rank_starts(override, code, message, tmp_path):
    """A real process: Hydra's error, and ours after it composed the config (test_bad_input runs many more in-process,
    an unknown schedule among them)."""
    out = run_train(override, f"output_dir={tmp_path}")
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert "starting" not in out.stdout


def summary_of(out: subprocess.CompletedProcess) -> tuple[int, float, float, float, float]:
    match = SUMMARY.search(out.stdout)
    assert match, f"no summary line in the output:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    steps, first, last, tokens, predicted, tflops = match.groups()
    assert float(predicted.replace(",", "")) > 0  # calibrated on this machine: a prediction in its own units
    return int(steps), float(first), float(last), float(tokens.replace(",", "")), float(tflops)


@pytest.mark.slow
def test_default_job_trains_on_the_two_cluster_topology(tmp_path):
    out = run_train("cluster=two_cluster_mixed", f"output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting 4 ranks" in out.stdout
    assert DEPRECATION.findall(out.stdout + out.stderr) == []
    steps, first, last, tokens_per_s, tflops = summary_of(out)
    assert steps == 30
    assert last < first - 1.0
    assert tokens_per_s > 0 and tflops > 0
    peaks = re.search(r"peak memory per rank ([\d.e-]+)-([\d.e-]+) GB \(planned up to ([\d.e-]+)\)", out.stdout)
    assert peaks and 0 < float(peaks[1]) <= float(peaks[2]) and float(peaks[3]) > 0, out.stdout[-2000:]
    (metrics,) = tmp_path.glob("*/csv/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert any(row.get("val_loss") for row in rows) and any(row.get("train/device/items_per_sec") for row in rows)


@needs_lab
@pytest.mark.slow
@pytest.mark.lab
def test_in_the_lab_the_job_is_planned_for_the_lab_links(tmp_path):
    """The lab runs 200 Gb/s InfiniBand at 200 x 1/5000 Gb/s: the plan's links say so, and the calibration why."""
    out = run_train(
        "lab=emulate",
        "lab.bandwidth_scale=0.0002",
        "trainer.max_steps=6",
        "checkpoint.every_n_steps=null",
        "trainer.val_check_interval=null",
        f"output_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout + out.stderr  # the plan comes through Lightning's logger
    assert "bandwidth_scale=1/5000 (lab.bandwidth_scale)" in printed  # the lab says so; the ranks plan on its links
    # 200 and 100 Gb/s at 1/5000, at what RDMA (0.9) and TCP (0.4) deliver of their line rates
    assert re.search(r"rdma 0\.036 Gb/s +tcp 0\.008 Gb/s", printed), printed[-3000:]
