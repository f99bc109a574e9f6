"""`bench=paper_regime`: the lab job whose predicted step splits as the paper setting's does, derived by the planner.

The reference is the planner's own prediction for the paper's setting (`bench.match`: GPT-7.5B on `paper_4ib_4roce` at
512 sequences per step), made at the degrees the bench pins (`strategy.pp=2`) with the plan CLI's defaults (NCCL):
Holmes' plan, its homogeneous limit, the NIC-unaware layout, flat FSDP and DDP, as the bench runs them in the lab. Its
homogeneous step splits into compute, DP sync, p2p and bubble (`SHARES`); Holmes' step against the others' gives the
ratios the lab should reproduce.

The lab job is derived from those numbers, not set by hand. For every candidate model (`match.d_models` x
`match.seq_lens`, each calibrated on this machine) and global batch (`match.global_batches`), the planner plans the
lab's runs at every bandwidth scale of a grid (steps of 1.2x, from the fastest the lab shapes exactly down) and predicts
them as the bench does (`plan_variants`: planned for the cluster the lab emulates, timed as they run on this machine's
shared cores, so the ratios are the ones the lab can measure); a candidate qualifies when each share of its homogeneous
step is within `match.share_tolerance` of the reference's and its runs' predicted steps fit `match.measured_budget_s`,
with Holmes' step at least `match.min_step_s`. Among those, the one whose share and ratio deviations, each in units of
its tolerance, are smallest at worst is the lab job (ties: the shorter run). That job's model is then timed again,
longer (`match.calibration_seconds`), and its batch and bandwidth scale derived again on those costs (`rederive`): its
runs are planned and predicted with the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from holmes_lightning.bench.calibrate import LabCalibration
from holmes_lightning.bench.config import BenchSettings, RegimeMatch
from holmes_lightning.bench.variants import REFERENCE, Hardware, plan_alternatives, plan_variants
from holmes_lightning.cli.config import ConfigError, ModelConfig
from holmes_lightning.lab.design import MAX_LAB_MBIT
from holmes_lightning.lab.scale import fastest_link_gbps
from holmes_lightning.planner import BatchSettings, MachineCosts, ModelProfile, Plan, PlanOptions, StepPrediction
from holmes_lightning.topology import Topology

SHARES = ("compute_s", "dp_sync_s", "p2p_s", "bubble_s")  # of the homogeneous step, matched within a tolerance
RATIO_RUNS = ("nic_unaware", "fsdp", "ddp")  # their step / Holmes', matched relative to the reference's
MATCHED_RUNS = (REFERENCE, "holmes_homogeneous", *RATIO_RUNS)
SCALE_STEP = 1.2
SCALE_STEPS = 30  # the grid spans 1.2^30 ~ 240x below the fastest exact scale


def shares(prediction: StepPrediction) -> dict[str, float]:
    """What fraction of the predicted step each of `SHARES` takes."""
    return {name: getattr(prediction, name) / prediction.total_s for name in SHARES}


def communication_share(prediction: StepPrediction) -> float:
    """DP sync and transfers' share of the predicted step."""
    return (prediction.dp_sync_s + prediction.p2p_s) / prediction.total_s


def ratios(plans: dict[str, Plan]) -> dict[str, float]:
    """Each of `RATIO_RUNS`' predicted step / Holmes'."""
    holmes = plans[REFERENCE].prediction.total_s
    return {name: plans[name].prediction.total_s / holmes for name in RATIO_RUNS}


@dataclass(frozen=True)
class Reference:
    """The planner's prediction for the reference setting: Holmes' plan and the runs it is compared with there."""

    name: str
    global_batch: int
    plans: dict[str, Plan]

    @classmethod
    def plan(cls, match: RegimeMatch, requested: PlanOptions) -> Reference:
        """Plan the reference setting at the degrees the bench pins Holmes to (`requested`'s pp and dp: the job's
        `strategy`, pp=2 by default, as the paper compares at), as `python -m holmes_lightning.cli.plan` does by
        default otherwise. Left free, the planner takes pp=8 there (one node a stage, DP over NVLink), whose stage
        that finishes last idles on the busier stages for 45% of the step: no lab job of 4 ranks splits that way."""
        topology = Topology.from_config(match.cluster)
        profile = ModelProfile.from_gpt(match.model)
        batch = BatchSettings(match.global_batch)
        options = PlanOptions(pp=requested.pp, dp=requested.dp)
        plans = plan_alternatives(topology, profile, batch, options=options, costs=MachineCosts(), names=MATCHED_RUNS)
        return cls(f"{match.model.name} on {topology.name}", match.global_batch, plans)

    @property
    def shares(self) -> dict[str, float]:
        return shares(self.plans["holmes_homogeneous"].prediction)

    @property
    def ratios(self) -> dict[str, float]:
        return ratios(self.plans)

    @property
    def communication_share(self) -> float:
        return communication_share(self.plans[REFERENCE].prediction)


@dataclass(frozen=True)
class Candidate:
    """One lab job at one bandwidth scale: its predicted shares and ratios, and how far they are from the reference."""

    model: ModelConfig
    global_batch: int
    calibration: LabCalibration
    shares: dict[str, float]
    ratios: dict[str, float]
    step_s: float
    share_deviation: float
    ratio_deviation: float
    score: float

    @property
    def bandwidth_scale(self) -> float:
        return self.calibration.bandwidth_scale


@dataclass(frozen=True)
class Regime:
    """The derived lab job (`choice`, its runs' predicted seconds of measured steps) and what it was derived from."""

    reference: Reference
    choice: Candidate
    measured_s: float
    candidates: int
    qualified: int

    def settings(self, settings: BenchSettings) -> BenchSettings:
        """The bench's settings with the derived model, batch and bandwidth scale."""
        return replace(
            settings,
            model=self.choice.model,
            global_batch=self.choice.global_batch,
            bandwidth_scale=self.choice.bandwidth_scale,
        )

    def describe(self) -> str:
        choice, match = self.choice, self.reference
        model = choice.model
        return (
            f"lab job derived from {match.name} at {match.global_batch} sequences: GPT {model.n_layers}x"
            f"{model.d_model} (seq {model.seq_len}), global batch {choice.global_batch}, bandwidth scale "
            f"{choice.bandwidth_scale:.3g}; shares off by at most {choice.share_deviation:.3f}, ratios by "
            f"{choice.ratio_deviation:.1%} ({self.qualified} of {self.candidates} candidates qualified)"
        )


def lab_model(match: RegimeMatch, d_model: int, seq_len: int) -> ModelConfig:
    return ModelConfig(
        name=f"gpt_regime_{match.n_layers}x{d_model}_s{seq_len}",
        n_layers=match.n_layers,
        d_model=d_model,
        n_heads=d_model // match.head_dim,
        seq_len=seq_len,
    )


def scale_grid(topology: Topology) -> list[float]:
    """Bandwidth scales from the fastest the lab shapes exactly down, in steps of `SCALE_STEP`, two digits each."""
    fastest = MAX_LAB_MBIT / 1000 / fastest_link_gbps(topology)
    return [float(f"{fastest / SCALE_STEP**k:.2g}") for k in range(SCALE_STEPS)]


def evaluate(
    hybrid: Topology,
    settings: BenchSettings,
    *,
    model: ModelConfig,
    profile: ModelProfile,
    global_batch: int,
    calibration: LabCalibration,
    requested: PlanOptions,
    reference: Reference,
) -> Candidate | None:
    """The lab job's shares and ratios as its runs are planned and predicted at the calibration's bandwidth scale
    (`plan_variants`: for the cluster the lab emulates, timed on this machine's shared cores); None: it cannot be
    planned."""
    match = settings.match
    assert match is not None  # derive checks it
    lab_settings = replace(settings, model=model, global_batch=global_batch, variants=list(MATCHED_RUNS))
    try:
        variants = plan_variants(Hardware.derive(hybrid, lab_settings, calibration), profile, lab_settings, requested)
    except ValueError:  # PlanError, or an alternative without a plan: not a candidate
        return None
    plans = {variant.name: variant.plan for variant in variants}
    predicted = shares(plans["holmes_homogeneous"].prediction)
    predicted_ratios = ratios(plans)
    share_deviation = max(abs(predicted[name] - reference.shares[name]) for name in SHARES)
    ratio_deviation = max(abs(predicted_ratios[name] / reference.ratios[name] - 1) for name in RATIO_RUNS)
    return Candidate(
        model=model,
        global_batch=global_batch,
        calibration=calibration,
        shares=predicted,
        ratios=predicted_ratios,
        step_s=plans[REFERENCE].prediction.total_s,
        share_deviation=share_deviation,
        ratio_deviation=ratio_deviation,
        score=max(share_deviation / match.share_tolerance, ratio_deviation / match.ratio_tolerance),
    )


def derive(
    hybrid: Topology,
    settings: BenchSettings,
    *,
    requested: PlanOptions,
    calibrate: Callable[[ModelConfig], tuple[ModelProfile, LabCalibration]],
    reference: Reference | None = None,
) -> Regime:
    """The lab job that reproduces `settings.match` best (see the module's docstring); `calibrate` profiles a model
    and measures a lab rank's costs for it; `reference`: the match's, if already planned."""
    match = settings.match
    if match is None:
        raise ConfigError("bench.match is not set: derive a regime only for a bench that names its reference")
    reference = reference or Reference.plan(match, requested)
    scales = scale_grid(hybrid)
    best: list[tuple[float, float, Candidate]] = []
    candidates = 0
    for d_model in match.d_models:
        for seq_len in match.seq_lens:
            model = lab_model(match, d_model, seq_len)
            profile, measured = calibrate(model)
            for global_batch in match.global_batches:
                found = [
                    evaluate(
                        hybrid,
                        settings,
                        model=model,
                        profile=profile,
                        global_batch=global_batch,
                        calibration=measured.at_scale(scale, "derived from bench.match"),
                        requested=requested,
                        reference=reference,
                    )
                    for scale in scales
                ]
                qualified = [
                    c
                    for c in found
                    if c is not None and c.share_deviation <= match.share_tolerance and c.step_s >= match.min_step_s
                ]
                candidates += len(found)
                for candidate in sorted(qualified, key=lambda c: c.score):
                    seconds = measured_seconds(
                        hybrid, candidate=candidate, profile=profile, settings=settings, requested=requested
                    )
                    if seconds <= match.measured_budget_s:
                        best.append((candidate.score, seconds, candidate))
                        break
    if not best:
        raise ConfigError(
            f"bench.match: no lab job predicts shares within bench.match.share_tolerance={match.share_tolerance} of "
            f"{reference.name}'s ({_format(reference.shares)}) with a step of at least bench.match.min_step_s="
            f"{match.min_step_s} s in bench.match.measured_budget_s={match.measured_budget_s} s; allow a wider "
            f"tolerance, more time or other bench.match.d_models / seq_lens / global_batches"
        )
    _, seconds, choice = min(best, key=lambda item: item[:2])
    return Regime(reference=reference, choice=choice, measured_s=seconds, candidates=candidates, qualified=len(best))


def rederive(
    regime: Regime,
    hybrid: Topology,
    settings: BenchSettings,
    *,
    requested: PlanOptions,
    measured: tuple[ModelProfile, LabCalibration],
) -> Regime:
    """`regime`'s model with its global batch and bandwidth scale derived again on `measured` costs."""
    model = regime.choice.model
    assert settings.match is not None  # regime was derived from it
    match = replace(settings.match, d_models=[model.d_model], seq_lens=[model.seq_len])
    return derive(
        hybrid,
        replace(settings, match=match),
        requested=requested,
        calibrate=lambda _: measured,
        reference=regime.reference,
    )


def measured_seconds(
    hybrid: Topology, *, candidate: Candidate, profile: ModelProfile, settings: BenchSettings, requested: PlanOptions
) -> float:
    """Predicted seconds of every run's steps (warm-up included) for this lab job."""
    lab_settings = replace(settings, model=candidate.model, global_batch=candidate.global_batch)
    hardware = Hardware.derive(hybrid, lab_settings, candidate.calibration)
    variants = plan_variants(hardware, profile, lab_settings, requested)
    return settings.steps * sum(variant.plan.prediction.total_s for variant in variants)


def _format(values: dict[str, float], names: Sequence[str] = SHARES) -> str:
    return ", ".join(f"{name.removesuffix('_s')} {values[name]:.3f}" for name in names)
