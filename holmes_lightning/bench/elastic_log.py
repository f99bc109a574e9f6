"""What bench=elastic reads of its job: the output lines, stamped as they arrived, and the checkpoints' save times.

From the kill on, each phase ends at the first line after the previous phase's end that marks it (`PHASES`). Each
launch's plan and predicted tokens/s come from its `holmes plan:` block. Training speed is measured between
consecutive checkpoints of one launch, from the end of one save (its `complete.json` written) to the start of the next
(its ranks' first files), so the saves themselves are left out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from holmes_lightning.runtime.checkpoint import COMPLETE_FILE

PHASES = (  # name, what it covers, the line that ends it (a regular expression)
    ("detection", "the launcher notices the dead rank", r"holmes: rank \d+ on node \S+ was killed by"),
    ("stop", "the other ranks stop, the nodes left are chosen", r"holmes: node \S+ lost"),
    ("start-up", "the ranks start again and join", r"All distributed processes registered"),
    ("planning", "calibration and a plan for the nodes left", r"holmes plan:"),
    ("set-up", "process groups, model, optimizer on that plan", r"Restoring states from the checkpoint"),
    ("checkpoint load", "the DCP checkpoint read onto that plan", r"Restored all states from the checkpoint"),
    ("first step", "the first training step after the resume", r"holmes: step \d+ done, the first since"),
)
PLAN = re.compile(r"holmes plan: (.*)")
PREDICTED = re.compile(r"predicted step ([\d.]+) s .*; ([\d,]+) tokens/s")
LAB = re.compile(r"holmes lab: (\d+) nodes .*bandwidth_scale=(\S+)")
SUMMARY = re.compile(r"holmes: \d+ steps, .*\| ([\d,]+) tokens/s \(predicted ([\d,]+)")


@dataclass(frozen=True)
class Line:
    """One line of the job's output and when the bench read it (`time.time()`)."""

    at: float
    text: str


@dataclass(frozen=True)
class Phase:
    name: str
    covers: str
    start: float
    end: float
    ended_by: str  # the line that marked its end

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class LaunchPlan:
    """One launch's plan as its rank 0 printed it: the layout, and the predicted step and tokens/s."""

    at: float
    layout: str
    predicted_step_s: float
    predicted_tokens_per_s: float


@dataclass(frozen=True)
class Save:
    """One checkpoint: its step, the ranks that wrote it, and when its save started and ended."""

    step: int
    world_size: int
    started: float
    ended: float


@dataclass(frozen=True)
class Speed:
    """Training between consecutive checkpoints of one launch: steps, their seconds, tokens/s."""

    steps: int
    seconds: float
    tokens_per_s: float


def phases(lines: Sequence[Line], killed_at: float) -> list[Phase]:
    """The phases from the kill to the first step after the resume; a ValueError names the line that never came."""
    found, start = [], killed_at
    rest = iter([line for line in lines if line.at >= killed_at])
    for name, covers, mark in PHASES:
        line = next((line for line in rest if re.search(mark, line.text)), None)
        if line is None:
            raise ValueError(f"bench elastic: no line {mark!r} after the kill ({name} never ended)")
        found.append(Phase(name, covers, start, line.at, line.text.strip()))
        start = line.at
    return found


def plans(lines: Sequence[Line]) -> list[LaunchPlan]:
    """Every `holmes plan:` block in the output, in order, with the prediction that follows its first line."""
    found = []
    for index, line in enumerate(lines):
        if (chosen := PLAN.search(line.text)) is None:
            continue
        predicted = next(m for later in lines[index + 1 :] if (m := PREDICTED.search(later.text)))
        found.append(LaunchPlan(line.at, chosen[1], float(predicted[1]), _number(predicted[2])))
    return found


def lab_scales(lines: Sequence[Line]) -> list[str]:
    """The bandwidth scale of each launch's lab network, as the lab printed it (e.g. `1/5500`)."""
    return [m[2] for line in lines if (m := LAB.search(line.text))]


def summary(lines: Sequence[Line]) -> tuple[float, float] | None:
    """The run summary's tokens/s and its prediction (the last launch's, over its last window of steps)."""
    found = [(_number(m[1]), _number(m[2])) for line in lines if (m := SUMMARY.search(line.text))]
    return found[-1] if found else None


def speed(saves: Sequence[Save], tokens_per_step: int) -> Speed:
    """Training speed over consecutive checkpoints of one launch, each save's own seconds left out."""
    ordered = sorted(saves, key=lambda save: save.step)
    pairs = list(zip(ordered, ordered[1:], strict=False))
    if not pairs:
        raise ValueError(f"bench elastic: {len(ordered)} checkpoint(s) in a launch; tokens/s need two")
    steps = sum(later.step - earlier.step for earlier, later in pairs)
    seconds = sum(later.started - earlier.ended for earlier, later in pairs)
    return Speed(steps, seconds, steps * tokens_per_step / seconds)


def read_saves(directory: Path) -> list[Save]:
    """Every complete checkpoint in `directory`: the save started when its ranks wrote their random states (their
    first file, after the save's opening barrier) and ended when `complete.json` was written."""
    found = []
    for folder in sorted(directory.glob("[!.]*")):
        complete = folder / COMPLETE_FILE
        if not complete.is_file():
            continue
        summary_ = json.loads(complete.read_text())
        started = min(path.stat().st_mtime for path in folder.glob("rng_rank*.pt"))
        found.append(Save(summary_["global_step"], summary_["world_size"], started, complete.stat().st_mtime))
    return found


def _number(text: str) -> float:
    return float(text.replace(",", ""))
