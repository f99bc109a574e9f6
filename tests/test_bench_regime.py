"""`bench=paper_regime` without the lab: the lab job derived from a reference setting, and its config's checks."""

from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from holmes_lightning.bench.calibrate import LabCalibration
from holmes_lightning.bench.config import BenchSettings, RegimeMatch, register_bench_configs
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.regime import SHARES, derive, rederive, shares
from holmes_lightning.bench.variants import Hardware, plan_variants
from holmes_lightning.cli.config import ConfigError, ModelConfig, register_configs
from holmes_lightning.measure.calibration import Calibration
from holmes_lightning.planner import MachineCosts, PlanOptions
from holmes_lightning.topology import Topology, config_dir

REFERENCE_MODEL = ModelConfig(name="ref", n_layers=12, d_model=1024, n_heads=16, seq_len=1024)


def measured_alone(model: ModelConfig) -> tuple:
    """A lab rank's costs as a calibration would give them (fixed here: the derivation is what is tested)."""
    costs = MachineCosts(
        efficiency=1.0,  # the lab topology's devices run at the measured speed
        layer_overhead_s=1e-3,
        optimizer_s_per_gb=1.0,
        fsdp_layer_s=3e-4,
        fsdp_reshard_layer_s=3e-3,
        fsdp_optimizer_layer_s=5e-4,
        latency_s=3e-4,
        dp_overlap=0.0,
    )
    calibration = Calibration(
        gflops=50.0, pass_overhead_s=4e-3, optimizer_s=5e-3, share=0.5, device_tflops=0.025, costs=costs
    )
    return BenchModel(gpt=model).profile(), LabCalibration(calibration, 1.0, "configured link speeds")


def paper_match(**overrides) -> RegimeMatch:
    fields = dict(
        cluster=Topology.from_config("paper_4ib_4roce").spec,
        model=REFERENCE_MODEL,
        global_batch=256,
        n_layers=4,
        d_models=[128, 256],
        seq_lens=[128],
        global_batches=[16, 32],
        head_dim=64,
        measured_budget_s=1e4,
        min_step_s=0.05,
    )
    return RegimeMatch(**{**fields, **overrides})


def test_the_derived_lab_job_splits_its_step_as_the_reference_does():
    hybrid = Topology.from_config("two_cluster_mixed")
    match = paper_match()
    settings = BenchSettings(name="regime", match=match, variants=["holmes_hybrid", "holmes_homogeneous", "ddp"])
    requested = PlanOptions(pp=2)
    regime = derive(hybrid, settings, requested=requested, calibrate=measured_alone)

    pipelined = {name: plan.pp for name, plan in regime.reference.plans.items() if name not in ("fsdp", "ddp")}
    assert set(pipelined.values()) == {2}  # the reference at the degrees the bench pins, as its runs are
    reference = regime.reference.shares
    assert set(reference) == set(SHARES) and sum(reference.values()) <= 1.0 + 1e-9
    chosen = regime.settings(settings)
    assert chosen.model.d_model in match.d_models and chosen.model.n_layers == match.n_layers
    assert chosen.global_batch in match.global_batches
    assert chosen.bandwidth_scale == regime.choice.bandwidth_scale
    # The bench then plans the chosen job as every run does; its homogeneous step splits within the tolerance.
    profile, calibration = measured_alone(chosen.model)
    hardware = Hardware.derive(hybrid, chosen, calibration.at_scale(chosen.bandwidth_scale, "derived"))
    runs = {v.name: v.plan for v in plan_variants(hardware, profile, chosen, requested)}
    lab = shares(runs["holmes_homogeneous"].prediction)
    assert all(abs(lab[name] - reference[name]) <= match.share_tolerance for name in SHARES)
    assert lab == pytest.approx(regime.choice.shares)
    assert runs["holmes_hybrid"].prediction.total_s >= match.min_step_s
    assert 0 < regime.measured_s <= match.measured_budget_s
    assert 1 <= regime.qualified <= regime.candidates


def test_the_chosen_model_measured_again_gets_its_batch_and_scale_from_the_new_costs():
    hybrid = Topology.from_config("two_cluster_mixed")
    settings = BenchSettings(name="regime", match=paper_match(), variants=["holmes_hybrid", "holmes_homogeneous"])
    requested = PlanOptions(pp=2)
    first = derive(hybrid, settings, requested=requested, calibrate=measured_alone)
    profile, calibration = measured_alone(first.choice.model)
    measured = calibration.calibration  # a second, luckier timing:
    lucky = replace(measured, gflops=150.0, device_tflops=0.075, costs=replace(measured.costs, fsdp_layer_s=1e-3))
    faster = replace(calibration, calibration=lucky)
    again = rederive(first, hybrid, settings, requested=requested, measured=(profile, faster))
    assert again.choice.model == first.choice.model and again.candidates < first.candidates
    assert again.reference is first.reference  # planned once
    assert again.choice.calibration.calibration == (faster.calibration)
    assert again.choice.bandwidth_scale > first.choice.bandwidth_scale  # 3x the compute speed: links 3x as fast
    assert again.choice.share_deviation <= settings.match.share_tolerance


def test_no_lab_job_within_the_tolerance_is_an_error_naming_the_fields():
    settings = BenchSettings(name="regime", match=paper_match(share_tolerance=1e-6), variants=["holmes_homogeneous"])
    with pytest.raises(ConfigError, match=r"bench\.match\.share_tolerance=1e-06.*bench\.match\.d_models"):
        derive(
            Topology.from_config("two_cluster_mixed"), settings, requested=PlanOptions(pp=2), calibrate=measured_alone
        )


def test_a_bench_without_a_reference_cannot_derive_one():
    with pytest.raises(ConfigError, match="bench.match is not set"):
        derive(
            Topology.from_config("two_cluster_mixed"),
            BenchSettings(),
            requested=PlanOptions(),
            calibrate=measured_alone,
        )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"global_batch": 0}, "bench.match.global_batch"),
        ({"share_tolerance": 0.0}, "bench.match.share_tolerance"),
        ({"min_step_s": -1.0}, "bench.match.min_step_s"),
        ({"seq_lens": []}, "bench.match.seq_lens"),
        ({"global_batches": [16, -2]}, "bench.match.global_batches"),
        ({"d_models": [128, 100]}, "bench.match.d_models"),
    ],
)
def test_bad_match_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        paper_match(**overrides)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prediction_tolerance": 0.0}, "bench.prediction_tolerance"),
        ({"kind": "regret", "variants": ["two_cluster_mixed", "no_such_cluster"]}, "bench.variants"),
        ({"kind": "regret"}, "bench.variants"),  # the speed runs' names are not clusters
        ({"kind": "memory"}, "bench.variants"),  # nor memory runs
        ({"kind": "latency"}, "bench.kind"),
    ],
)
def test_bad_bench_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        BenchSettings(**overrides)


def compose_bench(*overrides: str):
    register_configs()
    register_bench_configs()
    with initialize_config_dir(str(config_dir()), version_base=None):
        return compose("benchmark", overrides=list(overrides))


def test_the_shipped_paper_regime_names_the_paper_setting_as_its_reference():
    config = OmegaConf.to_object(compose_bench("bench.match.global_batch=256", "bench=paper_regime"))
    match = config.bench.match
    assert (match.cluster.name, match.model.name, match.global_batch) == ("paper_4ib_4roce", "gpt_7_5b", 256)
    assert config.bench.prediction_tolerance == 0.05
    assert "holmes_free" in config.bench.variants


def test_a_misspelled_match_key_is_an_error():
    with pytest.raises(Exception, match="d_model"):
        compose_bench("bench=paper_regime", "bench.match.d_model=256")
