"""The GPU check's parts that run without a GPU: the script's syntax, its decisions, and the whole check on gloo."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from holmes_lightning.cli import gpu_check

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize(("gpus", "layout"), [(1, (1, 1)), (2, (2, 1)), (8, (2, 4)), (3, (3, 1))])
def test_every_gpu_takes_part(gpus: int, layout: tuple[int, int]) -> None:
    pp, dp = gpu_check.layout_for(gpus)
    assert (pp, dp) == layout and pp * dp == gpus


def test_losses_must_match_the_single_process_run() -> None:
    assert gpu_check.loss_mismatch([5.0, 4.0], [5.01, 4.05]) is None
    assert (
        gpu_check.loss_mismatch([5.0, 4.0], [5.0, 4.2]) == "step 1: loss 4.20000, one process gave 4.00000 (rtol 0.02)"
    )
    assert gpu_check.loss_mismatch([5.0, 4.0], [5.0, float("nan")]).startswith("step 1: loss nan")
    assert gpu_check.loss_mismatch([5.0, 4.0], [5.0]) == "1 step losses, expected 2"


@pytest.mark.skipif(gpu_check.torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_without_a_gpu_the_check_fails_with_one_line(capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main([]) == 1
    (output,) = capsys.readouterr().out.splitlines()
    assert output.startswith("gpu_check: environment: FAILED: ")


@pytest.mark.slow
def test_the_script_runs_every_check_on_cpu_processes() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(SCRIPT), "--device", "cpu"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [text.split(":")[1] for text in lines] == [" environment", " 1 process", " 2 processes"]
    assert all(": ok (" in text for text in lines)
    assert "pp=1 x dp=1, fsdp on gloo, bf16" in lines[1] and "pp=2 x dp=1, fsdp on gloo" in lines[2]
