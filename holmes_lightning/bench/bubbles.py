"""A speed bench's run per pipeline schedule (`bench.schedules`): each schedule's bubble, measured next to the
prediction, as a Markdown table, a JSON record and a bar chart.

Measured, on the rank whose passes took longest in a step (`runner.pipeline_shares`): its passes' share of the step
(the slowest rank's), and its waits inside the schedule call (the call less its passes: what it waited for its
neighbours). Predicted, for the stage that finishes last: compute's share, and bubble plus p2p's, the part of the
step the schedule and the transfers it cannot hide leave that stage idle; bubble alone beside it. The waits hold both
the bubble and the transfers, as the lab cannot time them apart.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from holmes_lightning.bench.runner import RunResult  # noqa: E402


def predicted_shares(result: RunResult) -> tuple[float, float, float]:
    """Compute's, bubble plus p2p's and bubble's share of the predicted step."""
    p = result.predicted
    return p["compute_s"] / p["total_s"], (p["bubble_s"] + p["p2p_s"]) / p["total_s"], p["bubble_s"] / p["total_s"]


def schedule_table(runs: list[RunResult], refused: dict[str, str]) -> list[str]:
    """Markdown lines: a row per schedule run, then the schedules the planner refused and why."""
    lines = [
        "Per schedule (Holmes on the hybrid cluster, the schedule pinned): the busiest rank's passes and its waits on "
        "its neighbours inside the schedule call (bubble and exposed transfers), of the step, measured; predicted for "
        "the stage that finishes last.",
        "",
        "| schedule | layout | step s (median) | predicted s | passes, measured | compute, predicted | waits, measured "
        "| bubble + p2p, predicted | bubble, predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        compute, idle, bubble = predicted_shares(r)
        measured = ("-", "-") if r.passes_share is None else (f"{r.passes_share:.2f}", f"{r.waits_share:.2f}")
        lines.append(
            f"| {r.label.removeprefix('Holmes, ')} | {r.layout} | {r.median_s:.3f} | {r.predicted_s:.3f} | "
            f"{measured[0]} | {compute:.2f} | {measured[1]} | {idle:.2f} | {bubble:.2f} |"
        )
    lines += [f"\n{schedule}: not run, {reason}" for schedule, reason in refused.items()]
    return lines


def schedule_record(runs: list[RunResult], refused: dict[str, str]) -> dict:
    """The schedule runs for the bench's JSON, each with its predicted shares."""
    rows = []
    for r in runs:
        compute, idle, bubble = predicted_shares(r)
        rows.append({**asdict(r), "predicted_shares": {"compute": compute, "bubble_p2p": idle, "bubble": bubble}})
    return {"runs": rows, "refused": refused}


def draw_schedules(path: Path, runs: list[RunResult]) -> None:
    """Per schedule: the busiest rank's waits measured, next to bubble + p2p and bubble predicted, shares of the
    step; the measured step above."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    positions = range(len(runs))
    waits = ax.bar([p - width for p in positions], [r.waits_share or 0.0 for r in runs], width, label="waits, measured")
    predicted = [predicted_shares(r) for r in runs]
    ax.bar(list(positions), [idle for _, idle, _ in predicted], width, label="bubble + p2p, predicted")
    ax.bar([p + width for p in positions], [bubble for *_, bubble in predicted], width, label="bubble, predicted")
    ax.bar_label(waits, labels=[f"{r.median_s:.2f} s" for r in runs], fontsize=8)
    ax.set_xticks(list(positions), [r.label.removeprefix("Holmes, ") for r in runs], fontsize=8)
    ax.set_ylabel("share of the step")
    ax.set_title("Idle share of the step per schedule: busiest rank measured, last stage predicted (label: step)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
