"""`python3 -m holmes_lightning.cli.gpu_check`: does HolmesStrategy's real path train on this machine's GPU?

One GPU is enough: every multi-rank piece runs on it. FSDP2 with its bf16 mixed-precision policy is forced onto the
one-rank DP mesh (`HolmesStrategy(fsdp_on_one_rank=True)`) and Interleaved1F1B puts two virtual pipeline stages (two
PipelineStages, two FSDP2 chunks) on the one rank. Checks, one line each, exit code 1 if any fails:

  environment               torch's CUDA and NCCL, the GPU and its bf16; lightning, hydra-core, omegaconf
  calibration               `measure.calibration`'s timing of the model's layers in fp32, bf16 and bf16-mixed under
                            FSDP2's mixed-precision policy (FSDP+MP): their TFLOPS; on GPUs bf16 must beat fp32
  nccl_net                  the net NCCL selected (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET in the training job)
  train                     bf16-mixed, FSDP2 + MP on every layer (weights in bf16 in forward), 2 virtual stages,
                            gradient clipping (every norm after it at most the limit), validation, a checkpoint at
                            step 3, a run resumed from it: its losses and validation loss equal the uninterrupted run's
  activation_checkpointing  the same run with every layer checkpointed: the same losses, a lower peak memory; both
                            runs' step times
  memory_estimate           the uninterrupted run's peak memory (GPU: torch.cuda.max_memory_allocated; CPU: resident
                            memory above what the process held besides the model) against the plan's estimate
                            (StagePlan.memory_gb), within `MEMORY_RATIO`
  multi_gpu                 pp=2 x dp (up to 4) on 2 x dp GPUs, the same data and global batch: losses equal to the
                            one-GPU run's (bf16 tolerance); skipped on fewer than 2 GPUs

The model (`WORKLOADS`) is the recipe GPT (`cli.models.gpt`) built on the meta device, as train.py builds it. On
GPUs: the widths of conf/model/gpt_7_5b.yaml (d_model 4096, 32 heads, vocabulary 50304, 2048-token sequences) with
4 of its 36 blocks: 1.23 B parameters, 20 GB of fp32 weights, gradients and AdamW states, and 134 TFLOP per step of
8 sequences (under half a second at 40% of an H200's bf16 peak; estimated, not yet measured), so that the four
one-GPU jobs, a ~15 GB checkpoint written and read among them, fit in about 3 minutes. The full sequence length
stays: activations at it are what activation checkpointing and the memory estimate are about. On CPU (`--device
cpu`, gloo, what the tests run) the same GPT at d_model 128 and 256 tokens: wide in activations and small in weights
as the big one is on the GPU, so that activation checkpointing still shows in resident memory; bf16 autocast and
FSDP2's policy run there too, and nccl_net reports the gloo backend instead.

Each run is a fresh `torchrun --standalone` job (`gpu_check_job`, started as a user would start it). They write
under $TMPDIR (a ~15 GB checkpoint on GPUs), removed when every check passed and kept, with each job's output, when
one failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.launch.shutdown import skip_exit_collections

SEED = 7
CLIP_NORM = 0.1  # small enough that the GPT's gradients at initialisation are clipped in every step
SCHEDULE = "Interleaved1F1B"  # two chunks per stage: two virtual stages on a one-rank pipeline
CALIBRATION_SECONDS = 0.5  # per distinct layer and precision (the default 1.5 s is for a shared CPU's drift)
CALIBRATED = {"fp32": "32-true", "bf16": "bf16-true", "FSDP+MP": "bf16-mixed"}  # name -> Lightning precision
JOB_TIMEOUT_S = 600
# resumed or recomputed, the same arithmetic; on GPUs some kernels add in another order (attention's backward)
SAME_RUN_RTOL = {"cpu": 1e-6, "cuda": 1e-3}
LOSS_RTOL = 2e-2  # another pipeline split: bf16 micro-batches of other sizes, summed in another order
MEMORY_RATIO = (0.67, 1.5)  # measured peak / the plan's estimate. The estimate counts activations as profiled (fp32,
# attention's score matrix) and leaves out what forcing FSDP2 onto one rank holds: its bf16 copy of the weights and
# unsharded gradients (the planner counts these only for dp > 1). Beyond 1.5x a plan it accepts may not fit.
MULTI_MICROBATCHES = 2  # per step and replica with pp=2: Interleaved1F1B's micro-batches are a multiple of pp
MAX_MULTI_DP = 4  # the global batch (8 on GPUs) splits into dp replicas x 2 micro-batches
NCCL_NET = re.compile(r"NCCL INFO Using network (?P<net>.+?)\s*$", re.MULTILINE)
NCCL_NET_DETAIL = re.compile(r"NCCL INFO (?P<line>NET/(?P<net>[\w-]+) ?: Using .*?)\s*$", re.MULTILINE)
DEPENDENCIES = ("lightning", "hydra-core", "omegaconf")


@dataclass(frozen=True)
class Workload:
    """The GPT every run of a check trains, its batches and steps (the same data in every run)."""

    model: ModelConfig
    global_batch: int
    microbatches: int
    steps: int = 5
    checkpoint_step: int = 3  # the uninterrupted run writes a checkpoint after this step; the resumed run starts there
    val_batches: int = 2
    precision: str = "bf16-mixed"


WORKLOADS = {
    "cuda": Workload(
        ModelConfig(name="gpt_7_5b_widths", n_layers=4, d_model=4096, n_heads=32, seq_len=2048, vocab_size=50304),
        global_batch=8,
        microbatches=4,
    ),
    "cpu": Workload(
        ModelConfig(name="gpt_cpu_check", n_layers=4, d_model=128, n_heads=4, seq_len=256, vocab_size=256),
        global_batch=16,
        microbatches=4,
    ),
}


@dataclass(frozen=True)
class TrainRun:
    """One training job: its layout, activation checkpointing, and the checkpoint it writes or resumes from."""

    device: str
    pp: int = 1
    dp: int = 1
    microbatches: int | None = None  # None: the workload's
    checkpointing: str = "off"
    save_dir: str | None = None
    resume_from: str | None = None


@dataclass(frozen=True)
class CalibrationRun:
    """The calibration job: the workload's layers timed in each precision of `CALIBRATED`."""

    device: str


def job_spec(run: TrainRun | CalibrationRun) -> str:
    """`run` as the JSON argument a job takes."""
    kind = "calibrate" if isinstance(run, CalibrationRun) else "train"
    return json.dumps({"kind": kind, **asdict(run)})


@dataclass(frozen=True)
class Outcome:
    """One check's result: a problem (failed), or what was found (ok), or the GPUs it needs (skipped)."""

    check: str
    problem: str | None = None
    detail: str = ""
    needs_gpus: int | None = None

    @property
    def failed(self) -> bool:
        return self.problem is not None

    def line(self) -> str:
        """`gpu_check: CHECK: ok (DETAIL)`, `... FAILED: PROBLEM` or `... skipped (needs N GPUs)`."""
        if self.needs_gpus is not None:
            return f"gpu_check: {self.check}: skipped (needs {self.needs_gpus} GPUs)"
        return f"gpu_check: {self.check}: " + (f"FAILED: {self.problem}" if self.failed else f"ok ({self.detail})")


@dataclass(frozen=True)
class Job:
    """A finished torchrun job: rank 0's report (None if it failed), why it failed, where its output is."""

    name: str
    report: dict[str, Any] | None
    problem: str | None
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


def selected_nets(log: str) -> list[str]:
    """The nets NCCL says it uses in `log` ("IB", "Socket", a plugin's name), each once, in order of appearance."""
    return list(dict.fromkeys(match["net"] for match in NCCL_NET.finditer(log)))


def net_details(log: str, net: str) -> list[str]:
    """NCCL's `NET/<net> : Using ...` lines for `net` (its devices or interfaces), each once."""
    return list(dict.fromkeys(m["line"] for m in NCCL_NET_DETAIL.finditer(log) if m["net"] == net))


def loss_mismatch(reference: Sequence[float], measured: Sequence[float], rtol: float) -> str | None:
    """Why `measured` losses are not `reference`'s (None when every one agrees within `rtol`)."""
    if len(measured) != len(reference):
        return f"{len(measured)} losses, expected {len(reference)}"
    for step, (want, got) in enumerate(zip(reference, measured, strict=True)):
        if not math.isfinite(got) or abs(got - want) > rtol * abs(want):
            return f"loss {step}: {got:.6g}, expected {want:.6g} (rtol {rtol:g})"
    return None


def largest_gap(reference: Sequence[float], measured: Sequence[float]) -> float:
    """The largest relative difference between two equally long loss lists."""
    return max(abs(a - b) / abs(a) for a, b in zip(reference, measured, strict=True))


def memory_problem(measured_gb: float, estimate_gb: float, bounds: tuple[float, float] = MEMORY_RATIO) -> str | None:
    """Why a measured peak is too far from the plan's estimate (None when their ratio is within `bounds`)."""
    low, high = bounds
    if estimate_gb <= 0:
        return f"the plan estimates {estimate_gb:g} GB"
    ratio = measured_gb / estimate_gb
    if low <= ratio <= high:
        return None
    return (
        f"measured {measured_gb:.3g} GB, the plan estimates {estimate_gb:.3g} GB: {ratio:.2f}x, outside {low}-{high}x"
    )


def installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "missing"


def environment_outcome(device: str) -> Outcome:
    """What torch, the GPUs and the Python dependencies give; a problem that stops every other check."""
    libraries = ", ".join(f"{name} {installed(name)}" for name in DEPENDENCIES)
    if device == "cpu":
        return Outcome("environment", detail=f"torch {torch.__version__}, {libraries}, CPU processes on gloo")
    if torch.version.cuda is None:
        return Outcome("environment", f"torch {torch.__version__} has no CUDA (a CPU build); install a CUDA build")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return Outcome("environment", f"torch {torch.__version__} finds no GPU (driver? CUDA_VISIBLE_DEVICES?)")
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    found = f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} x "
    found += f"{', '.join(names)}, {libraries}"
    if not torch.cuda.is_bf16_supported():
        return Outcome("environment", f"no bf16 on {', '.join(names)}: HolmesStrategy trains in bf16 or fp32")
    return Outcome("environment", detail=found)


def failed_job(check: str, *jobs: Job) -> Outcome | None:
    """A FAILED outcome naming the first of `jobs` that failed, or None."""
    for job in jobs:
        if job.problem is not None:
            return Outcome(check, f"the {job.name} run: {job.problem}")
    return None


def calibration_outcome(job: Job, device: str) -> Outcome:
    """The three precisions' TFLOPS; on GPUs bf16 and FSDP+MP must beat fp32 (else bf16 is not in use)."""
    failed = failed_job("calibration", job)
    if failed:
        return failed
    assert job.report is not None
    measured = job.report["precisions"]
    tflops = {name: measured[name]["tflops"] for name in CALIBRATED}
    detail = ", ".join(f"{name} {value:.3g} TFLOPS" for name, value in tflops.items())
    detail += f" (FSDP2 hooks +{measured['FSDP+MP']['fsdp_pass_ms']:.2f} ms per pass) on {job.report['device']}"
    if not all(math.isfinite(value) and value > 0 for value in tflops.values()):
        return Outcome("calibration", f"not every precision measured: {detail}")
    if device == "cuda" and min(tflops["bf16"], tflops["FSDP+MP"]) <= tflops["fp32"]:
        return Outcome("calibration", f"bf16 is not faster than fp32: {detail}")
    return Outcome("calibration", detail=detail)


def nccl_net_outcome(job: Job, device: str) -> Outcome:
    """The net NCCL chose for the training job's communicators, from its INIT/NET log."""
    failed = failed_job("nccl_net", job)
    if failed:
        return failed
    assert job.report is not None
    if device == "cpu":
        return Outcome("nccl_net", detail=f"{job.report['backend']} on CPU: no NCCL communicator, no net to read")
    log = job.text()
    nets = selected_nets(log)
    if not nets:
        return Outcome("nccl_net", f"no 'NCCL INFO Using network' line in {job.log} (NCCL_DEBUG=INFO not honoured?)")
    details = [line for net in nets for line in net_details(log, net)]
    return Outcome("nccl_net", detail=", ".join(f"NET/{net}" for net in nets) + "".join(f"; {d}" for d in details))


def structure_problem(report: dict[str, Any], layers: int) -> str | None:
    """Why the run did not take the path the check forces: one rank, FSDP2 + MP, two virtual stages."""
    wanted = {
        "pp": 1,
        "dp": 1,
        "sharding": "fsdp",
        "virtual_stages": 2,
        "local_stages": 2,
        "schedule": "ScheduleInterleaved1F1B",
        "fsdp_modules": layers,
        "dtensor_params": True,
        "forward_dtypes": ["torch.bfloat16"],
    }
    wrong = [
        f"{key}={report.get(key)!r} (wanted {value!r})" for key, value in wanted.items() if report.get(key) != value
    ]
    return ", ".join(wrong) or None


def clipping_problem(report: dict[str, Any]) -> str | None:
    """Why the run's clipping is not shown to work: a norm above the limit after it, or none above it before."""
    before, after = max(report["norms_before"], default=0.0), max(report["norms_after"], default=math.inf)
    if after > CLIP_NORM * (1 + 1e-3):
        return f"a gradient norm of {after:.4g} after clipping to {CLIP_NORM}"
    if before <= CLIP_NORM:
        return f"no gradient norm above {CLIP_NORM} before clipping (largest {before:.4g}): clipping untested"
    return None


def train_outcome(base: Job, resumed: Job, device: str) -> Outcome:
    """The forced path, clipping, validation, the checkpoint, and the resumed run equal to the uninterrupted one."""
    failed = failed_job("train", base, resumed)
    if failed:
        return failed
    assert base.report is not None and resumed.report is not None
    work = WORKLOADS[device]
    layers = work.model.n_layers + 2
    checkpoint = f"step={work.checkpoint_step}.ckpt"
    uninterrupted, after = base.report, resumed.report
    problem = (
        structure_problem(uninterrupted, layers)
        or clipping_problem(uninterrupted)
        or (None if uninterrupted["checkpoints"] == [checkpoint] else f"checkpoints {uninterrupted['checkpoints']}")
        or loss_mismatch(
            [*uninterrupted["losses"][work.checkpoint_step :], uninterrupted["val_loss"]],
            [*after["losses"], after["val_loss"]],
            SAME_RUN_RTOL[device],
        )
    )
    if problem:
        return Outcome("train", problem)
    gap = largest_gap([*uninterrupted["losses"][work.checkpoint_step :]], after["losses"])
    detail = (
        f"{work.model.name}, bf16-mixed, pp=1 x dp=1, {uninterrupted['virtual_stages']} virtual stages "
        f"({uninterrupted['schedule']}), FSDP2+MP on {layers} layers (weights bf16 in forward), clipped to "
        f"{CLIP_NORM} (norms up to {max(uninterrupted['norms_before']):.3g}), losses "
        f"{[round(v, 4) for v in uninterrupted['losses']]}, val_loss {uninterrupted['val_loss']:.4f}; resumed from "
        f"{checkpoint}: {len(after['losses'])} losses and val_loss equal (largest gap {gap:.1e})"
    )
    return Outcome("train", detail=detail)


def median_step_s(report: dict[str, Any]) -> float:
    """The median step time after the first (which allocates optimizer states and warms kernels up)."""
    return statistics.median(report["step_s"][1:] or report["step_s"])


def checkpointing_outcome(base: Job, full: Job, device: str) -> Outcome:
    """Every layer checkpointed: the same losses, a lower peak; both runs' step times."""
    failed = failed_job("activation_checkpointing", base, full)
    if failed:
        return failed
    assert base.report is not None and full.report is not None
    off, on = base.report, full.report
    problem = (
        (None if on["checkpointing"] == "full" else f"the plan's checkpointing is {on['checkpointing']}")
        or loss_mismatch([*off["losses"], off["val_loss"]], [*on["losses"], on["val_loss"]], SAME_RUN_RTOL[device])
        or (None if on["peak_gb"] < off["peak_gb"] else f"peak {on['peak_gb']:.3g} GB, not below {off['peak_gb']:.3g}")
    )
    if problem:
        return Outcome("activation_checkpointing", problem)
    detail = (
        f"off: peak {off['peak_gb']:.3g} GB, {median_step_s(off) * 1e3:.0f} ms/step; full: peak {on['peak_gb']:.3g} "
        f"GB, {median_step_s(on) * 1e3:.0f} ms/step; losses equal (largest gap "
        f"{largest_gap(off['losses'], on['losses']):.1e})"
    )
    return Outcome("activation_checkpointing", detail=detail)


def memory_outcome(base: Job, full: Job, device: str) -> Outcome:
    """The uninterrupted run's peak against its plan's estimate, within `MEMORY_RATIO`; the checkpointed run's ratio
    is shown beside it."""
    failed = failed_job("memory_estimate", base)
    if failed:
        return failed
    assert base.report is not None
    report = base.report
    kind = "allocated on the GPU" if device == "cuda" else "resident above the process's own"
    problem = memory_problem(report["peak_gb"], report["memory_gb"])
    if problem:
        return Outcome("memory_estimate", problem)
    ratio = report["peak_gb"] / report["memory_gb"]
    detail = (
        f"peak {report['peak_gb']:.3g} GB {kind}, the plan's estimate {report['memory_gb']:.3g} GB: {ratio:.2f}x, "
        f"within {MEMORY_RATIO[0]}-{MEMORY_RATIO[1]}x"
    )
    if full.report is not None:
        on = full.report
        detail += f"; activation checkpointing: {on['peak_gb']:.3g} / {on['memory_gb']:.3g} GB (not judged)"
    return Outcome("memory_estimate", detail=detail)


def multi_gpu_outcome(job: Job, base: Job) -> Outcome:
    """pp=2 on several processes, the same data: losses equal to the one-process run's within `LOSS_RTOL`."""
    failed = failed_job("multi_gpu", base, job)
    if failed:
        return failed
    assert job.report is not None and base.report is not None
    reference = [*base.report["losses"], base.report["val_loss"]]
    measured = [*job.report["losses"], job.report["val_loss"]]
    problem = loss_mismatch(reference, measured, LOSS_RTOL)
    if job.report["sharding"] != "fsdp":
        problem = problem or f"sharding {job.report['sharding']}"
    if problem:
        return Outcome("multi_gpu", problem)
    report = job.report
    detail = (
        f"pp={report['pp']} x dp={report['dp']} ({report['virtual_stages']} virtual stages) on {report['backend']}, "
        f"the same data: losses within {largest_gap(reference, measured):.1e} of the one-process run's"
    )
    return Outcome("multi_gpu", detail=detail)


def multi_gpu_processes(device: str, requested: int | None) -> int | None:
    """Processes of the multi_gpu run: 2 x dp, dp as large as the devices allow up to `MAX_MULTI_DP`; None: too few
    (CPU: two processes unless asked)."""
    available = requested or 2
    if device == "cuda":
        available = min(requested or torch.cuda.device_count(), torch.cuda.device_count())
    if available < 2:
        return None
    return 2 * min(available // 2, MAX_MULTI_DP)


def child_env(device: str, workdir: Path) -> dict[str, str]:
    """The jobs' environment: NCCL's INIT/NET log, one calibration cache for every job, glibc returning freed
    memory on CPU (so resident memory follows the tensors)."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HOLMES_CALIBRATION_DIR": str(workdir / "calibration"),
        "HOLMES_CALIBRATION_SECONDS": str(CALIBRATION_SECONDS),
    }
    env.setdefault("OMP_NUM_THREADS", "1" if device == "cpu" else "8")
    if device == "cuda":
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
    else:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    return env


def run_job(name: str, run: TrainRun | CalibrationRun, *, processes: int, workdir: Path) -> Job:
    """Run `run` as a `torchrun --standalone` job of `processes` ranks; rank 0's report."""
    report, log = workdir / f"{name}.json", workdir / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "holmes_lightning.cli.gpu_check_job",
        job_spec(run),
        str(report),
    ]
    with log.open("w") as output:
        try:
            done = subprocess.run(
                command,
                env=child_env(run.device, workdir),
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=JOB_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return Job(name, None, f"no result after {JOB_TIMEOUT_S} s (a hang?); its output: {log}", log)
    if done.returncode != 0 or not report.is_file():
        return Job(name, None, f"exit code {done.returncode}; its output: {log}", log)
    return Job(name, json.loads(report.read_text()), None, log)


def run_checks(device: str, processes: int | None) -> int:
    """Every check, one line each as it completes; 0 if none failed."""
    outcomes = [environment_outcome(device)]
    print(outcomes[0].line(), flush=True)
    if outcomes[0].failed:
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="holmes_gpu_check_"))  # the jobs' output; kept if a check fails

    def check(outcome: Outcome) -> None:
        outcomes.append(outcome)
        print(outcome.line(), flush=True)

    one = {"processes": 1, "workdir": workdir}
    check(calibration_outcome(run_job("calibration", CalibrationRun(device), **one), device))
    base = run_job("uninterrupted", TrainRun(device, save_dir=str(workdir / "checkpoints")), **one)
    check(nccl_net_outcome(base, device))
    checkpoint = workdir / "checkpoints" / f"step={WORKLOADS[device].checkpoint_step}.ckpt"
    check(train_outcome(base, run_job("resumed", TrainRun(device, resume_from=str(checkpoint)), **one), device))
    full = run_job("checkpointed", TrainRun(device, checkpointing="full"), **one)
    check(checkpointing_outcome(base, full, device))
    check(memory_outcome(base, full, device))
    several = multi_gpu_processes(device, processes)
    if several is None:
        check(Outcome("multi_gpu", needs_gpus=2))
    else:
        run = TrainRun(device, pp=2, dp=several // 2, microbatches=MULTI_MICROBATCHES)
        check(multi_gpu_outcome(run_job("multi_gpu", run, processes=several, workdir=workdir), base))
    failed = any(outcome.failed for outcome in outcomes)
    if failed:
        print(f"gpu_check: the jobs' output is in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m holmes_lightning.cli.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same checks on gloo")
    parser.add_argument(
        "--processes", type=int, default=None, help="devices multi_gpu may use (default: every GPU; on CPU 2)"
    )
    args = parser.parse_args(argv)
    skip_exit_collections()
    return run_checks(args.device, args.processes)


if __name__ == "__main__":
    sys.exit(main())
