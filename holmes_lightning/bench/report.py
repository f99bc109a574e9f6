"""The benchmark's outputs: the regime check, the targets, a Markdown table, a JSON file and a bar chart."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from holmes_lightning.bench.runner import RunResult  # noqa: E402
from holmes_lightning.bench.variants import REFERENCE, Variant  # noqa: E402
from holmes_lightning.calibration import Calibration  # noqa: E402
from holmes_lightning.planner import ModelProfile  # noqa: E402

MB = 1e6
PREDICTION_TOLERANCE = 0.15


@dataclass(frozen=True)
class Target:
    """`value` = `slower` run's median step / `faster` run's; met when it reaches `minimum`."""

    name: str
    faster: str
    slower: str
    minimum: float
    value: float | None

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.value >= self.minimum


def regime(variants: list[Variant], profile: ModelProfile, global_batch: int) -> dict:
    """Gradient bytes per step vs activation bytes crossing a stage boundary, and communication's predicted share."""
    holmes = next((v.plan for v in variants if v.name == REFERENCE), variants[0].plan)
    boundary_layers = [stage.chunks[-1][1] - 1 for stage in holmes.stages[:-1]]
    activation = max((profile.layers[i].activation_bytes for i in boundary_layers), default=0.0)
    crossing = 2 * activation * global_batch  # every sample's output forward and its gradient back
    p = holmes.prediction
    return {
        "gradient_bytes_per_step": profile.param_bytes,
        "boundary_bytes_per_step": crossing,
        "gradient_to_boundary": profile.param_bytes / crossing if crossing else None,
        "predicted_communication_share": (p.dp_sync_s + p.p2p_s) / p.total_s,
    }


def format_regime(check: dict) -> str:
    ratio = check["gradient_to_boundary"]
    ratio_text = f"{ratio:.1f}x" if ratio else "no stage boundary"
    holds = (ratio is None or ratio >= 5) and check["predicted_communication_share"] >= 0.2
    return (
        f"regime check: gradients {check['gradient_bytes_per_step'] / MB:.2f} MB/step vs "
        f"{check['boundary_bytes_per_step'] / MB:.3f} MB/step across a stage boundary ({ratio_text}); "
        f"communication {check['predicted_communication_share']:.0%} of Holmes' predicted step -> "
        f"{'the paper regime holds' if holds else 'NOT the paper regime (raise d_model or lower the batch)'}"
    )


def targets(results: list[RunResult]) -> list[Target]:
    median = {r.name: r.median_s for r in results}

    def ratio(faster: str, slower: str) -> float | None:
        return median[slower] / median[faster] if faster in median and slower in median else None

    rows = [
        ("Holmes hybrid / homogeneous limit", REFERENCE, "holmes_homogeneous", 0.90),
        ("Holmes hybrid / FSDPStrategy", REFERENCE, "fsdp", 3.0),
        ("Holmes hybrid / NIC-unaware layout", REFERENCE, "nic_unaware", 1.5),
        ("auto / uniform partition, unequal clusters", "holmes_unequal", "uniform_unequal", 1.15),
    ]
    return [Target(name, faster, slower, minimum, ratio(faster, slower)) for name, faster, slower, minimum in rows]


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def markdown(results: list[RunResult], context: dict, check: dict) -> str:
    reference = next((r.median_s for r in results if r.name == REFERENCE), None)
    lines = [
        f"# holmes-lightning benchmark: {context['bench']}",
        "",
        f"Model {context['model']}, global batch {context['global_batch']} sequences, {context['steps']}; "
        f"cost model per rank: {Calibration(**context['calibration']).describe()}.",
        "",
        format_regime(check),
        "",
        "| run | network | layout | step s (median) | tokens/s | TFLOPS/device | step / Holmes-hybrid's "
        "| predicted s | predicted / measured | other work (of the cores) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        versus = f"{r.median_s / reference:.2f}" if reference else "-"
        lines.append(
            f"| {r.label} | {r.network} | {r.layout} | {r.median_s:.3f} | {r.tokens_per_s:,.0f} | "
            f"{r.tflops_per_device:.2e} | {versus} | {r.predicted_s:.3f} | {r.predicted_s / r.median_s:.2f} | "
            f"{r.foreign_load:.0%} |"
        )
    lines += ["", "| target | value | needed | verdict |", "|---|---:|---:|---|"]
    for t in targets(results):
        value = "-" if t.value is None else f"{t.value:.2f}"
        lines.append(f"| {t.name} | {value} | >= {t.minimum:g} | {_verdict(t.met)} |")
    off = [r for r in results if abs(r.predicted_s / r.median_s - 1) > PREDICTION_TOLERANCE]
    within = len(results) - len(off)
    lines.append(
        f"| predicted / measured within {PREDICTION_TOLERANCE:.0%} | {within}/{len(results)} runs | all | "
        f"{_verdict(not off)}{' (off: ' + ', '.join(r.name for r in off) + ')' if off else ''} |"
    )
    return "\n".join(lines) + "\n"


def write_json(path: Path, results: list[RunResult], context: dict, check: dict) -> None:
    data = {
        "bench": context["bench"],
        "model": context["model"],
        "global_batch": context["global_batch"],
        "calibration": context["calibration"],
        "regime": check,
        "runs": [asdict(r) for r in results],
        "plans": {v.name: json.loads(v.plan.to_json()) for v in context["variants"]},
        "targets": [{**asdict(t), "met": t.met} for t in targets(results)],
    }
    path.write_text(json.dumps(data, indent=1))


def draw(path: Path, results: list[RunResult]) -> None:
    """Measured median step next to the predicted one per run, with each run's step / Holmes-hybrid's above it."""
    reference = next((r.median_s for r in results if r.name == REFERENCE), None)
    fig, ax = plt.subplots(figsize=(11, 5))
    positions = range(len(results))
    width = 0.38
    measured = ax.bar([p - width / 2 for p in positions], [r.median_s for r in results], width, label="measured")
    ax.bar([p + width / 2 for p in positions], [r.predicted_s for r in results], width, label="predicted (planner)")
    if reference:
        for bar, r in zip(measured, results, strict=True):
            ax.annotate(
                f"{r.median_s / reference:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=9,
            )
    ax.set_xticks(list(positions), [r.label.replace(", ", ",\n") for r in results], fontsize=8)
    ax.set_ylabel("seconds per step (median)")
    ax.set_title("Step time in the lab (label: step / Holmes-hybrid's; lower is faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
