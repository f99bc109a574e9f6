"""Main job: `python train.py cluster=two_cluster_mixed` trains the GPT recipe on one process per rank of the cluster;
`model=hf_llama` an HF causal LM, `model._target_=...` / `data._target_=...` your own LightningModule / DataModule.

Run plainly, it checks the config, then starts the cluster's ranks on this machine (or in the lab's emulated network
with `lab.mode=emulate`), each rerunning this script. Started by a launcher (ours, torchrun, SLURM), it is one rank
and joins the job as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import asdict

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from holmes_lightning.cli import validate
from holmes_lightning.cli.config import (
    ConfigError,
    CrossSite,
    HFModelConfig,
    TrainConfig,
    error_line,
    register_configs,
)
from holmes_lightning.cli.data import build_data, check_data
from holmes_lightning.cli.launch import start_ranks
from holmes_lightning.cli.models import build_model, check_model, flops_per_sample
from holmes_lightning.cli.sites import (
    choose_sites,
    latest_of_every_site,
    one_plan_for_every_site,
    site_dir,
    site_resume,
)
from holmes_lightning.cli.targets import added_keys
from holmes_lightning.launch import job
from holmes_lightning.launch.processes import LAUNCHED_ENV, launched_topology
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.planner import BatchSettings, ModelProfile, Plan, PlanError
from holmes_lightning.planner.sites import Grouping, diloco_options, grouping_label, site_options
from holmes_lightning.planner.survivors import plan_on_most_nodes
from holmes_lightning.recipes import RunSummary, throughput_monitor
from holmes_lightning.runtime import HolmesStrategy, checkpoint
from holmes_lightning.runtime.checkpoint import CheckpointError
from holmes_lightning.runtime.contract import ContractError
from holmes_lightning.runtime.diloco import Site, SiteError, SiteLaunch, runs_per_site
from holmes_lightning.runtime.environment import default_environment
from holmes_lightning.runtime.placement import launch_mismatch
from holmes_lightning.runtime.preemption import HolmesCheckpoint
from holmes_lightning.topology import Topology, TopologyError, config_dir

register_configs()
job.register_run_name_resolver()  # every rank of a torchrun/SLURM job names the run directory alike

LOGGERS = ("csv", "wandb")
KNOWN_ERRORS = (ConfigError, TopologyError, PlanError, CheckpointError, ContractError, SiteError)
TRACEBACKS = os.environ.get("HYDRA_FULL_ERROR") == "1"  # asked for: known errors then show theirs too


@hydra.main(version_base=None, config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    if not TRACEBACKS:  # set below only so that Hydra raises its config errors; the ranks need not inherit it
        os.environ.pop("HYDRA_FULL_ERROR", None)
    try:  # every check that needs no other process, so a bad value stops the job before any rank starts
        config: TrainConfig = OmegaConf.to_object(cfg)
        arguments = {node: added_keys(cfg[node]) for node in ("model", "data")}  # of a model/data `_target_`
        topology = launched_topology() or Topology.from_config(config.cluster)  # ours: less any node lost
        check_choices(config, topology)
        profile = check_model(config, arguments["model"], data_vocab=check_data(config, arguments["data"]))
        timeout_s = job.collective_timeout_s(config.strategy.timeout_s, os.environ)
        strategy = make_strategy(config, topology, timeout_s)
        site = launched_site(config)
        machines, batch = (topology, strategy.batch) if site is None else site_machines(config, topology, site)
        plan, options = None, strategy.options
        if site is not None:
            options = diloco_options(options)
        elif config.strategy.cross_site is CrossSite.diloco:  # pp, dp and partition describe a site
            options = site_options(options)
        if profile is not None:  # your own module's profile is known once the ranks build it: they check its plan
            plan = validate.check_plan(config, machines, batch, profile, options=options, costs=strategy.costs)
        sites, pinned = None, []
        if not is_rank_process():
            options, costs = strategy.options, strategy.costs
            sites = choose_sites(config, topology, plan, profile, batch=batch, options=options, costs=costs)
            if sites is not None and profile is not None:  # the site's options as given
                pinned = one_plan_for_every_site(config, topology, sites, profile, options=options, costs=costs)
        if sites is not None and config.resume == "auto":  # the newest step that every site saved
            newest = latest_of_every_site(config.checkpoint.dir, sites)
            config.resume = None if newest is None else str(newest)
        # the launcher reads every file once; ranks leave the digests to the load, where each reads its share
        config.resume = validate.resume_path(config, plan, checksums=not is_rank_process())
        if is_rank_process():
            world, least = default_environment().world_size(), config.elastic.min_nodes
            if (mismatch := launch_mismatch(machines, world, min_nodes=least)) is not None:
                raise TopologyError(mismatch)
    except (ValueError, OmegaConfBaseException) as err:  # config, topology, plan, checkpoint and strategy errors
        exit_with_error(err)
    run_dir = HydraConfig.get().runtime.output_dir
    if not is_rank_process():
        if plan is None:
            print(f"train.py: {config.model._target_} is profiled and planned once the ranks have built it", flush=True)
        sys.exit(start_job(config, topology, run_dir, survivors_plan(config, strategy, profile), sites, pinned))
    warn_once_about_timeout(config, topology, timeout_s)
    try:
        train(config, arguments, machines, strategy, run_dir, profile, None if site is None else site.label)
    except KNOWN_ERRORS as err:  # found once processes joined: raised alike on every rank that sees it
        exit_with_error(err, f"rank {default_environment().global_rank()}: ")


def exit_with_error(err: BaseException, where: str = "") -> None:
    """One line that says what to fix, and exit code 2 (with HYDRA_FULL_ERROR=1, the traceback instead)."""
    if TRACEBACKS:
        raise err
    print(f"error: {where}{error_line(err)}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_choices(config: TrainConfig, topology: Topology) -> None:
    if config.logger not in LOGGERS:
        raise ConfigError(f"logger={config.logger!r}: use one of {LOGGERS}")
    least, nodes = config.elastic.min_nodes, len(topology.nodes)
    if least is not None and least > nodes and not is_rank_process():
        raise ConfigError(f"elastic.min_nodes={least}: the cluster has {nodes} nodes; use at most {nodes}")


def is_rank_process() -> bool:
    """True when a launcher started this process as one rank (ours sets HOLMES_LAUNCHED; torchrun/SLURM theirs)."""
    return LAUNCHED_ENV in os.environ or default_environment().creates_processes_externally


def launched_site(config: TrainConfig) -> Site | None:
    """In a rank of a DiLoCo job (the launcher started its site as a job of its own): that site."""
    if not is_rank_process() or not runs_per_site(config.strategy.cross_site):
        return None
    return Site.launched(launched_topology() or config.cluster, SiteLaunch.from_env(), config.data.global_batch)


def site_machines(config: TrainConfig, topology: Topology, site: Site) -> tuple[Topology, BatchSettings]:
    """What this rank's site trains on, and its share of the batch; its checkpoints go in a folder of its own."""
    config.checkpoint.dir = site_dir(config.checkpoint.dir, site.label)
    config.resume = site_resume(config.resume, site.label) if config.resume != "auto" else "auto"
    config.data.global_batch = site.batch or config.data.global_batch
    return site.topology, BatchSettings(config.data.global_batch, config.strategy.microbatches)


def survivors_plan(
    config: TrainConfig, strategy: HolmesStrategy, profile: ModelProfile | None
) -> Callable[[Topology], Topology] | None:
    """After a lost node, which of the nodes left train (`plan_on_most_nodes`); None: your own module, planned by the
    ranks, gets every node left."""
    if profile is None:
        return None

    def plan(nodes: Topology) -> Plan:
        return validate.check_plan(
            config, nodes, strategy.batch, profile, options=strategy.options, costs=strategy.costs
        )

    return lambda survivors: plan_on_most_nodes(survivors, plan)[0]


def start_job(
    config: TrainConfig,
    topology: Topology,
    run_dir: str,
    training_nodes: Callable[[Topology], Topology] | None,
    sites: Grouping | None = None,
    pinned: list[str] | None = None,
) -> int:
    """One process per rank of the topology, all writing into this run's directory; `sites`: each site a job of
    its own (DiLoCo), every site's ranks running the plan `pinned` overrides give (`one_plan_for_every_site`)."""
    resume = f"resume='{config.resume}'" if config.resume else "resume=null"  # every rank resumes the same one
    pinned = pinned or []
    keys = {override.split("=", 1)[0] for override in pinned}
    given = [arg for arg in sys.argv[1:] if arg.split("=", 1)[0].lstrip("+") not in keys]
    command = [sys.executable, os.path.abspath(sys.argv[0]), *given, *pinned, f"hydra.run.dir='{run_dir}'", resume]
    if config.resume:
        print(f"train.py: resuming from {config.resume}", flush=True)
    print(topology, flush=True)
    over = "" if sites is None else f", DiLoCo over the sites {grouping_label(sites)}"
    print(f"train.py: starting {topology.world_size} ranks ({config.lab.mode}{over}); logs in {run_dir}", flush=True)
    return start_ranks(
        command,
        topology,
        config.lab,
        config.elastic,
        restart_command=lambda: resumed(command, config),
        training_nodes=training_nodes,
        sites=sites,
    )


def resumed(command: list[str], config: TrainConfig) -> list[str]:
    """The ranks' command after a lost node: from the newest complete checkpoint (none yet: from the start)."""
    path = checkpoint.latest(config.checkpoint.dir)
    print(f"train.py: resuming from {path}" if path else "train.py: no checkpoint yet: starting over", flush=True)
    return [*command[:-1], f"resume='{path}'" if path else "resume=null"]


def make_strategy(config: TrainConfig, topology: Topology, timeout_s: float) -> HolmesStrategy:
    """HolmesStrategy from the config's strategy group (built in the launcher too, so bad arguments stop it early)."""
    settings = config.strategy
    return HolmesStrategy(
        cluster=topology,
        global_batch=config.data.global_batch,
        microbatches=settings.microbatches,
        options=settings.settings(),
        calibrate=settings.calibrate,
        costs=settings.machine_costs(),
        replan=settings.replan,
        timeout=timeout_s,
        min_nodes=config.elastic.min_nodes,
        cross_site=settings.cross_site,
        diloco=config.diloco.settings(),
        checkpoint_frozen=not (isinstance(config.model, HFModelConfig) and config.model.base_read_at_start),
    )


def warn_once_about_timeout(config: TrainConfig, topology: Topology, timeout_s: float) -> None:
    """On rank 0 of a job that torchrun or SLURM started: a collective timeout too short for NCCL on many nodes."""
    if LAUNCHED_ENV in os.environ or default_environment().global_rank() != 0:
        return  # our launcher runs every rank on this one machine
    backend = validate.collective_backend(config.trainer.accelerator)
    warning = job.timeout_warning(timeout_s, backend, len(topology.nodes))
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def train(
    config: TrainConfig,
    arguments: dict[str, dict],
    topology: Topology,
    strategy: HolmesStrategy,
    run_dir: str,
    profile: ModelProfile | None,
    site: str | None = None,
) -> None:
    """This rank's part of the job: the configured model and data under HolmesStrategy, then a one-line summary on
    rank 0. `arguments`: those of a model or data `_target_`; `profile`: the model's, if known before the ranks;
    `site`: under DiLoCo, this rank's site."""
    L.seed_everything(config.seed, workers=True)
    opt = config.trainer
    model = build_model(config, arguments["model"])
    data = build_data(config, arguments["data"])
    window = max(2, min(20, opt.max_steps // 2))
    rank = default_environment().global_rank()
    saves = HolmesCheckpoint(
        config.checkpoint.dir,
        every_n_steps=config.checkpoint.every_n_steps,
        keep=config.checkpoint.keep,
        grace_s=config.checkpoint.grace_s,
    )
    trainer = L.Trainer(
        accelerator=opt.accelerator,
        **launched_devices(topology, rank),
        strategy=strategy,
        precision=opt.precision,
        max_steps=opt.max_steps,
        gradient_clip_val=opt.gradient_clip_val,
        accumulate_grad_batches=opt.accumulate_grad_batches,
        log_every_n_steps=opt.log_every_n_steps,
        val_check_interval=opt.val_check_interval,
        limit_val_batches=opt.limit_val_batches,
        logger=make_logger(config, run_dir, site),
        callbacks=[
            throughput_monitor(
                model,
                config.data.global_batch,
                default_environment().world_size(),
                window,
                lambda: saves.saving_s,
                flops_per_sample=flops_per_sample(model, profile),
            ),
            saves,
            RunSummary(),
        ],
        default_root_dir=run_dir,
    )
    trainer.fit(model, datamodule=data, ckpt_path=config.resume)  # HolmesStrategy ends its process groups at exit
    finished = trainer.global_step >= opt.max_steps  # not stopped by a signal: resume=auto goes on from there
    if isinstance(config.model, HFModelConfig) and config.checkpoint.hf and finished:
        export = os.path.join(run_dir, "hf" if site is None else f"hf-site-{site}")
        strategy.save_hf(export)
        if trainer.global_rank == 0:
            print(f"train.py: the trained model written as an HF directory: {export}", flush=True)


def launched_devices(topology: Topology, rank: int) -> dict[str, int]:
    """The Trainer's `devices` and `num_nodes`: this rank's node in the config's, or, when torchrun's elastic agent
    started fewer nodes (`elastic.min_nodes`), its processes per node and the nodes that joined."""
    world = default_environment().world_size()
    if world == topology.world_size:
        return {"devices": len(topology.node_of(rank).ranks), "num_nodes": len(topology.nodes)}
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {"devices": local, "num_nodes": world // local}


def make_logger(config: TrainConfig, run_dir: str, site: str | None) -> Logger:
    """CSV in the run directory (a restart after a lost node in `csv/restart-N`, so the runs before stay; under
    DiLoCo each site's in `csv/site-NAME`), or a Weights & Biases run kept offline there (`wandb sync` uploads it
    later; one per site)."""
    if config.logger == "wandb":
        name = None if site is None else f"site-{site}"
        return WandbLogger(project="holmes-lightning", name=name, save_dir=run_dir, offline=True, config=asdict(config))
    restart = job.restart_count(os.environ)
    parts = ([] if site is None else [f"site-{site}"]) + ([f"restart-{restart}"] if restart else [])
    return CSVLogger(save_dir=run_dir, name="csv", version="-".join(parts))


def cli() -> None:
    """`python train.py OVERRIDES...`: Hydra's config errors too end in one `error:` line and exit code 2."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its config errors to us instead of exiting with code 1
    skip_exit_collections()
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        exit_with_error(error)


if __name__ == "__main__":
    cli()
