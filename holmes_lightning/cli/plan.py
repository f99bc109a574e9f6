"""`python -m holmes_lightning.cli.plan cluster=two_cluster_mixed model=gpt_7_5b [plan.out=plan.png]`: plan, don't run.

Prints the topology (with the links between each pair of clusters), Holmes' plan (rank map, stages and their layers,
DP groups with NIC kind and link speed) and the predicted step of Holmes next to the alternatives; with several
clusters, one pipeline across them next to DiLoCo over each way of seeing them as sites (`diloco.*`).
`plan.verbose=true` adds what the search did, `plan.out` draws the cluster map and timelines, `plan.json` writes
Holmes' plan for `Plan.from_json`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from holmes_lightning.cli.config import ConfigError, HFModelConfig, ModelConfig, PlanJobConfig, register_configs
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanError, compare_plans
from holmes_lightning.planner.draw import draw_plans
from holmes_lightning.planner.report import format_comparison, format_cross_site, format_plan
from holmes_lightning.planner.search import SearchStats
from holmes_lightning.planner.sites import compare_cross_site
from holmes_lightning.topology import Topology, TopologyError, config_dir

register_configs()


def run(config: PlanJobConfig) -> dict:
    """Plan the configured job and print (and optionally draw and save) the result; returns the compared plans."""
    topology = Topology.from_config(config.cluster)
    profile = model_profile(config.model, config.plan.bytes_per_value)
    strategy, knobs = config.strategy, config.plan
    print(topology)
    trained = profile.trained_bytes / profile.param_bytes
    trains = "" if trained == 1 else f" ({trained:.2%} of them trained)"
    print(
        f"\nModel {profile.name}: {profile.num_layers} pipeline layers, {profile.param_bytes / 1e9:.2f} GB of weights"
        f"{trains}, global batch {config.data.global_batch} x {profile.tokens_per_sample} tokens\n"
    )
    batch = BatchSettings(config.data.global_batch, strategy.microbatches)
    stats = SearchStats.reporting(lambda line: print(line, flush=True))
    plans = compare_plans(
        topology, profile, batch, options=strategy.settings(), costs=strategy.machine_costs(), stats=stats
    )
    if knobs.verbose:
        print(stats.summary() + "\n")
    print(format_plan(plans["holmes"], profile))
    print()
    print(format_comparison(plans))
    if len(topology.spec.clusters) > 1:
        settings = config.diloco.settings()
        parameters = profile.trained_bytes / knobs.bytes_per_value
        found, problems = compare_cross_site(
            topology,
            profile,
            batch,
            parameters=parameters,
            settings=settings,
            options=strategy.settings(),
            costs=strategy.machine_costs(),
        )
        print()
        print(format_cross_site(plans["holmes"], found, problems, settings))
    if knobs.json:
        Path(knobs.json).write_text(plans["holmes"].to_json())
        print(f"\nwrote {knobs.json}")
    if knobs.out:
        print(f"wrote {draw_plans(plans, topology, knobs.out)}")
    return plans


def model_profile(model: ModelConfig | HFModelConfig, bytes_per_value: int) -> ModelProfile:
    """What is planned: the GPT's analytic profile, or an HF model's pipeline layers built from its config on the meta
    device (`model=hf_*`), in the training dtype."""
    if isinstance(model, HFModelConfig):
        from holmes_lightning.cli.models import hf_profile  # imports Lightning and transformers: only for HF models

        return hf_profile(model, bytes_per_value=bytes_per_value)
    if model._target_ is not None:
        raise ConfigError(
            f"model._target_={model._target_}: the plan CLI plans the GPT (model=gpt_*) and HF models (model=hf_*); "
            f"your module's layers are known once it is built: HolmesStrategy plans it at start and logs the plan"
        )
    return ModelProfile.from_gpt(model, bytes_per_value=bytes_per_value)


@hydra.main(version_base=None, config_path=str(config_dir()), config_name="plan")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(OmegaConf.to_object(cfg))
    except (ConfigError, PlanError, TopologyError) as err:
        sys.exit(f"plan: {err}")


def main() -> None:
    """Console entry point (`holmes-plan ...`)."""
    _hydra_main()


if __name__ == "__main__":
    main()
