"""Benchmarks: Holmes against Lightning's FSDP and DDP, a NIC-unaware layout, a uniform partition and the
homogeneous limit, all in the lab in one run (`python -m holmes_lightning.bench bench=short`)."""

from holmes_lightning.bench.config import VARIANTS, BenchJobConfig, BenchSettings
from holmes_lightning.bench.runner import RunResult, run_bench

__all__ = ["VARIANTS", "BenchJobConfig", "BenchSettings", "RunResult", "run_bench"]
