"""Measuring the machine and the model: layer profiles (FLOPs, bytes) and the calibration of what a rank costs."""

from holmes_lightning.measure.calibration import Calibration, Measurement
from holmes_lightning.measure.host import (
    available_cores,
    cpu_gflops,
    cpu_rank_gflops,
    file_resident_bytes,
    peak_resident_bytes,
    rank_share,
    resident_bytes,
    restart_peak_resident,
)
from holmes_lightning.measure.profile import first_sample, measure_layers, profile_modules

__all__ = [
    "Calibration",
    "Measurement",
    "available_cores",
    "cpu_gflops",
    "cpu_rank_gflops",
    "file_resident_bytes",
    "first_sample",
    "measure_layers",
    "peak_resident_bytes",
    "profile_modules",
    "rank_share",
    "resident_bytes",
    "restart_peak_resident",
]
