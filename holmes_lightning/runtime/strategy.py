"""`HolmesStrategy`: Lightning training on a Holmes Plan, pipeline stages over NIC groups with FSDP2 inside each.

Lightning's part only: `setup_environment` joins the processes and agrees on the Topology; `setup` (after the
DataModule's `setup` and `configure_model`, so layers built there are planned too) agrees on the plan
(`runtime.planning`), builds its process groups and ("pp", "dp") mesh (`runtime.groups`) and this rank's part of the
model (`runtime.assembly`); the steps run torch's pipeline schedule, checkpoints go through DCP (`runtime.checkpoint`).
"""

from __future__ import annotations

import atexit
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import MethodType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _set_rng_states, reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

import holmes_lightning.runtime.averaging as averaging
import holmes_lightning.runtime.checkpoint as checkpoint
import holmes_lightning.runtime.frozen as frozen
import holmes_lightning.runtime.resume as resume
from holmes_lightning.measure import calibration
from holmes_lightning.measure.calibration import Calibration
from holmes_lightning.planner import (
    Backend,
    BatchSettings,
    Checkpointing,
    LayoutKind,
    MachineCosts,
    ModelProfile,
    PartitionRule,
    Plan,
    PlanOptions,
    Schedule,
    SettingError,
    Sharding,
    check_batch,
    check_degrees,
)
from holmes_lightning.planner.options import choices
from holmes_lightning.planner.sites import CrossSite, DiLoCoSettings, diloco_options, grouping_label
from holmes_lightning.runtime.assembly import assemble
from holmes_lightning.runtime.contract import (
    check_automatic_optimization,
    check_contract,
    check_precision,
    missing_contract,
    prediction_inputs,
    split_batch,
)
from holmes_lightning.runtime.diloco import DiLoCo, Site, SiteLaunch, runs_per_site
from holmes_lightning.runtime.environment import NICGroupingEnvironment, cluster_source
from holmes_lightning.runtime.export import save_pretrained
from holmes_lightning.runtime.groups import PlanMesh, build_mesh, nccl_world
from holmes_lightning.runtime.hooks import log_every_stage, report_step, say_the_steps_that_do_not_run, step_hook
from holmes_lightning.runtime.pipeline import HeldGradients, Pipeline, gather_replica_outputs
from holmes_lightning.runtime.placement import choose_device, describe_emulation, host_position
from holmes_lightning.runtime.plan_reuse import PlanBasis
from holmes_lightning.runtime.planning import JobPlace, PlanRequest, SampleReading, agree_on_plan
from holmes_lightning.runtime.sharding import clip_grad_norm_, fsdp_modules
from holmes_lightning.runtime.ties import Tie, across_stages, find_ties
from holmes_lightning.topology import ClusterSpec, Topology

NOT_YET = "is made in setup, after the DataModule's setup and configure_model: read it from train_dataloader() or later"


def end_process_groups() -> None:
    """At exit: end every process group before the interpreter's teardown, where gloo's threads can abort the process
    ("terminate called without an active exception") after a run that went well."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def _frozen_stage_shown_trainable(module: nn.Module) -> Iterator[None]:
    """While `configure_optimizers` runs on a stage whose parameters are all frozen (a fine-tuned model's first
    layers): they are shown as trainable. An optimizer over the trainable parameters (`p.requires_grad`), as one builds
    for fine-tuning, is then not empty there, which torch refuses; they get no gradient, so it never changes them."""
    parameters = list(module.parameters())
    frozen = not any(parameter.requires_grad for parameter in parameters)
    for parameter in parameters if frozen else ():
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in parameters if frozen else ():
            parameter.requires_grad_(False)


@contextmanager
def _resharded_after(module: nn.Module) -> Iterator[None]:
    """Reshard FSDP2's modules after a forward that no backward follows, as the pipeline does after evaluating:
    `replicate` leaves the root's parameters unsharded for the backward it expects, so callbacks that read them
    before the next step (an EMA's swap after validation) would meet plain tensors beside the DTensors they copied."""
    yield
    for sharded in fsdp_modules(module):
        sharded.reshard()


class HolmesStrategy(ModelParallelStrategy):
    """Pipeline x FSDP2 over the NIC groups of `cluster`, on the Plan the Holmes planner picks (or the one given).

    Arguments:
        cluster: a shipped config name, a YAML path, a dict, a ClusterSpec or a Topology; None: the launched nodes,
            NIC kinds detected.
        global_batch: samples per optimizer step over all DP replicas (each replica's DataLoader gives
            `replica_batch_size`); None: as under DDP, each DP replica reads one batch of the DataLoader's own
            `batch_size` per step, and the planner also chooses dp for it (global batch = batch_size x dp).
            microbatches: per step and replica, None lets the planner choose.
        options: what to plan (`holmes_lightning.planner.PlanOptions`, as train.py and the plan CLI take it);
            schedule, partition, pp, dp, sharding, layout, activation_checkpointing override its fields (sharding
            "auto": FSDP2 unless replicas are faster; activation_checkpointing "auto": per stage, off where it fits
            the memory bound keeping every activation, else selective, else full; layout "nic_unaware": Megatron's
            rank order; schedule "auto": the planner's pick of every schedule it models, e.g.
            "InterleavedZeroBubble" or the V schedules "ZBVZeroBubble" and "DualPipeV").
        plan: a Plan (or its JSON file) to run instead of planning.
        profile: the model's cost profile; default: `pipeline_layers()` measured on `example_input_array`, else on one
            sample of the running entry point's DataLoader (meta layers: on meta tensors).
        calibrate: before planning, measure this machine on the model in the Trainer's precision
            (`holmes_lightning.measure.calibration`, each distinct layer 1.5 s, `$HOLMES_CALIBRATION_SECONDS`; cached
            per machine, model shape and precision); `strategy.calibration` keeps what was measured (None when a resume
            runs its checkpoint's plan again: nothing is calibrated then).
        costs: what the machine costs (`holmes_lightning.planner.MachineCosts`) where not calibrated: all of it with
            calibrate=False (default: the cluster config's TFLOPS x efficiency 0.5), else what calibration does not
            measure, such as `dp_overlap`. Every plan also fits the device's memory for training (its memory less a
            reserve; on CPU the host's available memory per rank), measured at start unless given.
        timeout: seconds (or a timedelta) a collective may wait before the job fails; the other ranks' wait for rank
            0's plan is not bound by it (`runtime.planning.from_rank_zero`).
        fsdp_on_one_rank: with sharding "fsdp", apply FSDP2 also to a stage whose DP group is one rank, where it has
            nothing to shard and is skipped by default: its hooks, DTensor parameters and mixed-precision policy
            then run as on many ranks, at the cost of a gathered copy of the weights. For checks of the multi-rank
            path on one device (`python -m holmes_lightning.cli.gpu_check`); the planner's estimates do not count it.
        replan: on a resume (`trainer.fit(ckpt_path=...)`, train.py's `resume=`), plan afresh. By default a resume
            runs the plan stored with its checkpoint again, uncalibrated, when the cluster, the number of pipeline
            layers and these settings are unchanged, so that it reproduces the uninterrupted run's losses; otherwise
            it plans afresh and logs why (`runtime.plan_reuse`).
        min_nodes: train on the nodes that join when fewer than the cluster lists do, down to this many (None: every
            node must join). torchrun's elastic agent (`--nnodes=MIN:MAX`) starts the nodes left after a failure;
            they are matched to the config's by hostname (in its order where it names none), the plan is made for
            them and the missing nodes are logged (`placement.attend`).
        cross_site: "pipeline" (one pipeline across every cluster), "diloco" (each site, a cluster or clusters joined
            by fast links, trains its own replica on its own plan and share of `global_batch` as a job of its own; the
            sites average their parameters' changes every `diloco.sync_every` inner steps through an outer Nesterov
            SGD, `runtime.diloco`) or "auto": DiLoCo where the launcher started the sites so (train.py does when
            `diloco.allowed=true` and DiLoCo is predicted faster), else one pipeline.
        diloco: DiLoCo's settings (`holmes_lightning.planner.sites.DiLoCoSettings`); default: the DiLoCo paper's.
        checkpoint_frozen: False: checkpoints leave out the weights that do not train (a LoRA fine-tune's base model),
            which a resume takes from the model as it built it; a resume whose frozen weights differ from the saved
            run's is refused (`runtime.frozen`). Only for models that build the same frozen weights at every start
            (from a pretrained directory); such checkpoints consolidate without them.
    """

    strategy_name = "holmes"

    def __init__(
        self,
        cluster: str | Path | dict | ClusterSpec | Topology | None = None,
        *,
        global_batch: int | None = None,
        microbatches: int | None = None,
        options: PlanOptions | None = None,
        schedule: Schedule | str | None = None,
        partition: PartitionRule | str | Sequence[int] | None = None,
        pp: int | None = None,
        dp: int | None = None,
        sharding: Sharding | str | None = None,
        layout: LayoutKind | str | None = None,
        activation_checkpointing: Checkpointing | str | None = None,
        plan: Plan | str | Path | None = None,
        profile: ModelProfile | None = None,
        calibrate: bool = True,
        costs: MachineCosts | None = None,
        timeout: float | timedelta = default_pg_timeout,
        process_group_backend: str | None = None,
        fsdp_on_one_rank: bool = False,
        replan: bool = False,
        min_nodes: int | None = None,
        cross_site: CrossSite | str = CrossSite.pipeline,
        diloco: DiLoCoSettings | None = None,
        checkpoint_frozen: bool = True,
    ) -> None:
        given = {"schedule": schedule, "partition": partition, "pp": pp, "dp": dp, "sharding": sharding}
        given.update(layout=layout, activation_checkpointing=activation_checkpointing)
        try:  # every setting is checked here, before any rank starts
            self.options = replace(options or PlanOptions(), **{k: v for k, v in given.items() if v is not None})
            self.batch = BatchSettings.requested(global_batch, microbatches)
        except SettingError as error:
            raise error.as_written_in(type(self).__name__) from None
        try:
            self.cross_site = CrossSite(cross_site)
        except ValueError:
            raise SettingError(type(self).__name__, "cross_site", cross_site, choices(CrossSite)) from None
        if calibrate:
            calibration.layer_seconds()  # a bad $HOLMES_CALIBRATION_SECONDS fails here, before any rank starts
        # Lightning 2.6's CombinedLoader flattens every batch with `lightning/pytorch/utilities/_pytree.py`
        # `_tree_flatten`, which builds `LeafSpec()`; torch >= 2.10 deprecates that class, so each rank printed a
        # FutureWarning once per run (Lightning-AI/pytorch-lightning#21326). Only that message from that module.
        warnings.filterwarnings(
            "ignore",
            message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
            category=FutureWarning,
            module=r"lightning\.pytorch\.utilities\._pytree",
        )
        seconds = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        super().__init__(process_group_backend=process_group_backend, timeout=seconds)
        self.cluster = cluster
        self.profile = profile
        self.calibrate = calibrate
        self.fsdp_on_one_rank = fsdp_on_one_rank
        self.checkpoint_frozen = checkpoint_frozen
        self.replan = replan
        self.min_nodes = min_nodes
        self.costs = costs or MachineCosts()
        self.calibration: Calibration | None = None
        self.plan: Plan | None = (
            plan if isinstance(plan, Plan) or plan is None else Plan.from_json(Path(plan).read_text())
        )
        self.topology: Topology | None = None
        self.plan_mesh: PlanMesh | None = None
        self._made_for: PlanBasis | None = None  # what the plan was made for: checkpoints store it with the plan
        self.pipeline: Pipeline | None = None
        self._prepared: nn.Module | None = None
        self._reading: SampleReading | None = None  # while rank 0 reads a DataLoader, before there is a plan
        self._gradients = HeldGradients(())
        self._ties: list[Tie] = []
        self._resumed_rng: dict[str, Any] | None = None
        self._device: torch.device | None = None
        self.diloco_settings = diloco or DiLoCoSettings()
        self.site: Site | None = None  # under DiLoCo: this rank's site, once the processes are configured
        self.diloco: DiLoCo | None = None

    @property
    def replica_batch_size(self) -> int:
        """Samples per training step that each DP replica's DataLoader must yield (global batch / dp).

        1 while rank 0 reads a DataLoader before there is a plan (a sample to profile the model on).
        """
        if self._reading is not None:
            self._reading.asked_batch_size = True
            return 1
        return self._require_plan().replica_batch

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over the DP dimension only: every stage of one DP column sees the same batch.

        While rank 0 reads a DataLoader before there is a plan (a sample to profile the model on, its batch size):
        a provisional split (one replica, or two to see whether the loader divides its batch among them), which a
        DataLoader built then keeps only for that reading.
        """
        if self._reading is not None:
            self._reading.asked_split = True
            return {"num_replicas": self._reading.replicas, "rank": 0}
        if self.plan_mesh is None:
            raise RuntimeError(f"HolmesStrategy: the data split (DP degree) {NOT_YET}")
        if self.site is not None:  # DiLoCo: every site's replicas read shards of their own
            return {"num_replicas": self.site.replicas, "rank": self.site.first_replica + self.plan_mesh.dp_index}
        return {"num_replicas": self._require_plan().dp, "rank": self.plan_mesh.dp_index}

    @contextmanager
    def _reading_data(self, replicas: int) -> Iterator[SampleReading]:
        """While rank 0 reads a DataLoader before there is a plan: a provisional data split of `replicas` replicas."""
        self._reading = SampleReading(replicas)
        try:
            yield self._reading
        finally:
            self._reading = None

    def _require_plan(self) -> Plan:
        if self.plan is None:
            raise RuntimeError(f"HolmesStrategy: the plan {NOT_YET}")
        return self.plan

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """Refuse a model the requested pipeline cannot run here, before any process group exists."""
        if self.options.pp not in (None, 1):
            check_contract(model, self.options.pp)
            if model.trainer.state.fn == TrainerFn.FITTING:
                check_automatic_optimization(model, f"pp={self.options.pp}")
        super().connect(model)

    @property
    @override
    def precision_plugin(self) -> Precision:
        return ModelParallelStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning hands the precision over in Trainer(), before any process starts: refuse fp16 with loss scaling."""
        if plugin is not None:
            check_precision(plugin.precision)
        ModelParallelStrategy.precision_plugin.fset(self, plugin)

    @override
    def _configure_launcher(self) -> None:
        """Lightning has chosen the launcher's environment by now: wrap it so it also yields the Topology, and stop a
        launch of the wrong size here, before Lightning's launcher starts any process."""
        if not isinstance(self.cluster_environment, NICGroupingEnvironment):
            source = cluster_source(self.cluster, nodes=self.num_nodes, processes_per_node=self.num_processes)
            if runs_per_site(self.cross_site):
                global_batch = None if self.batch is None else self.batch.global_batch
                self.site = Site.launched(source, SiteLaunch.from_env(), global_batch)
                self.options = diloco_options(self.options)
                source = self.site.topology
                if self.batch is not None and self.site.batch is not None:
                    self.batch = replace(self.batch, global_batch=self.site.batch)
            self.cluster_environment = NICGroupingEnvironment(
                source, inner=self.cluster_environment, min_nodes=self.min_nodes
            )
        spawned_here = not self.cluster_environment.creates_processes_externally
        self.cluster_environment.check_launch((self.num_processes, self.num_nodes) if spawned_here else None)
        self._check_request(self.cluster_environment.configured)
        super()._configure_launcher()

    def _check_request(self, configured: Topology | None) -> None:
        """Requested pipeline or DP degrees that no layout of the configured cluster takes, and a global batch that
        none of the degrees left splits into micro-batches, fail here, before any process starts. Not checked: NIC
        kinds detected at start, an elastic job (the nodes that join may take other degrees), and one stage (a module
        without the pipeline contract then runs FSDP over every rank)."""
        if configured is None or self.min_nodes is not None:
            return
        if self.options.pp == 1 or self.options.dp == configured.world_size:
            return
        check_degrees(configured, self.options)
        if self.batch is not None:
            check_batch(configured, self.options, self.batch)

    @property
    @override
    def root_device(self) -> torch.device:
        """This process's device: its place among the job's processes on this host (see `placement.choose_device`)."""
        if self._device is None:
            assert self.parallel_devices is not None and self.cluster_environment is not None
            host_rank, host_ranks = host_position(os.environ, self.local_rank, self.num_processes)
            self._device = choose_device(
                self.parallel_devices,
                visible=self.accelerator.auto_device_count() if self.accelerator is not None else 0,
                host_rank=host_rank,
                host_ranks=host_ranks,
                backend=self._process_group_backend
                or _get_default_process_group_backend_for_device(self.parallel_devices[0]),
            )
        return self._device

    @override
    def setup_environment(self) -> None:
        """Processes join and agree on the Topology; the plan and the mesh follow in `setup`, once the model exists.

        So, unlike under ModelParallelStrategy, `self.device_mesh` is not set yet in `configure_model`: build the
        layers there (on the meta device if they are big) and leave sharding to the strategy.
        """
        self._setup_distributed()
        assert isinstance(self.cluster_environment, NICGroupingEnvironment)
        self.topology = self.cluster_environment.exchange()
        if self.cluster_environment.emulated:
            rank_zero_info(describe_emulation(self.topology))

    def _setup_distributed(self) -> None:
        """The default group (on NCCL, with this process's NCCL environment: `groups.nccl_world`)."""
        ParallelStrategy.setup_environment(self)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        environment = self.cluster_environment
        assert isinstance(environment, NICGroupingEnvironment)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self._process_group_backend == "nccl":
            kwargs.update(nccl_world(environment, self.root_device))
        _init_dist_connection(environment, self._process_group_backend, **kwargs)
        atexit.unregister(end_process_groups)  # once, however many strategies a script sets up
        atexit.register(end_process_groups)

    def _plan_and_build_mesh(self, trainer: pl.Trainer) -> None:
        """The plan (made once per strategy, so fit and a later validate share it; a resume's may be its checkpoint's),
        its process groups and mesh."""
        if self.plan_mesh is None:
            assert self.topology is not None and isinstance(self.cluster_environment, NICGroupingEnvironment)
            request = PlanRequest(
                options=averaging.counted(self.options, trainer.callbacks, self.root_device),
                batch=self.batch,
                costs=self.costs,
                calibrate=self.calibrate,
                plan=self.plan,
                profile=self.profile,
                precision=self.precision_plugin.precision,
                replan=self.replan,
            )
            place = JobPlace(
                topology=self.topology,
                device=self.root_device,
                backend=Backend(self._get_process_group_backend()),
                local_rank=self.local_rank,
                local_processes=self.num_processes,
                broadcast=self.broadcast,
            )
            agreed = agree_on_plan(
                request,
                trainer=trainer,
                place=place,
                reading_data=self._reading_data,
                resuming=resume.checkpoint_to_load(trainer),
            )
            self.plan, self.calibration, self._made_for = agreed.plan, agreed.calibration, agreed.made_for
            rank_zero_info(agreed.description)
            module = self.lightning_module
            self._ties = [] if missing_contract(module) else find_ties(module.pipeline_layers())
            self.plan_mesh = build_mesh(
                self.plan,
                environment=self.cluster_environment,
                device=self.root_device,
                backend=self._get_process_group_backend(),
                timeout=self._timeout,
                tied_stages=[tie.stages(self.plan) for tie in across_stages(self._ties, self.plan)],
            )
            if self.site is not None:
                self.site.connect(self.global_rank, self.plan.dp, self._timeout)
        self._device_mesh = self.plan_mesh.mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        if self.pipeline is None:  # the whole model here, as in one process
            super().setup_optimizers(trainer)
            return
        with _frozen_stage_shown_trainable(self.lightning_module):
            super().setup_optimizers(trainer)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._plan_and_build_mesh(trainer)
        if self._prepared is not self.lightning_module:
            self._prepare(self.lightning_module)
        if self.pipeline is not None and trainer.state.fn == TrainerFn.FITTING:
            plan = self._require_plan()
            check_automatic_optimization(self.lightning_module, f"{plan.num_virtual_stages} pipeline stages")
        # Lightning evaluates and predicts under torch.inference_mode except on gloo and for its own FSDPStrategy
        # (loops/utilities.py `_no_grad_context`, pytorch/pytorch#95957); FSDP2's collectives on NCCL reject inference
        # tensors as well, so this strategy runs them under torch.no_grad, as Lightning does for FSDPStrategy.
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            averaging.average_stage(trainer.callbacks, self.lightning_module)
            if self.site is not None and self.diloco is None:
                self.diloco = self._start_diloco()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # total norm over every stage
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # bf16-mixed: Lightning's MixedPrecision refuses to clip for a fused optimizer (the recipe's AdamW), which
            # would unscale fp16 gradients itself (Lightning-AI/pytorch-lightning#21435); bf16 has no scaler
            plugin.clip_gradients = MethodType(Precision.clip_gradients, plugin)

    def _start_diloco(self) -> DiLoCo:
        """The outer loop over the parameters this rank's optimizers hold, with the same rank of every other site."""
        assert self.site is not None and self.site.group is not None and self.lightning_module is not None
        held = {id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in self.lightning_module.named_parameters() if id(p) in held]
        rank_zero_info(
            f"HolmesStrategy: DiLoCo, site {self.site.label} of {grouping_label(self.site.grouping)}, an outer step "
            f"every {self.diloco_settings.sync_every} inner steps"
        )
        sharded = any(isinstance(p, DTensor) for _, p in named)
        replicas = None if sharded or self.plan_mesh is None else self.plan_mesh.dp_group
        return DiLoCo(
            named,
            self.site.group,
            self.diloco_settings,
            site_label=self.site.label,
            replicas=replicas,
            regroup=self.site.regroup,
        )

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The inner step; under DiLoCo, then the outer loop's turn (`DiLoCo.after_inner_step`)."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.diloco is not None:
            assert self.lightning_module is not None
            self.diloco.after_inner_step(self.lightning_module.trainer.global_step + 1)
        return result

    @override
    def on_train_end(self) -> None:
        if self.diloco is not None:
            self.diloco.flush()
        super().on_train_end()

    def _prepare(self, module: pl.LightningModule) -> None:
        """This rank's part of the model (`assembly.assemble`), on its device, in the plan's precision."""
        assert self.plan_mesh is not None
        self.model = self.precision_plugin.convert_module(self.model)
        mixed = self.precision_plugin.precision == "bf16-mixed"
        self.pipeline = assemble(
            module,
            plan=self._require_plan(),
            mesh=self.plan_mesh,
            device=self.root_device,
            mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else MixedPrecisionPolicy(),
            seed=lambda: self.broadcast(torch.initial_seed()),
            ties=self._ties,
            fsdp_on_one_rank=self.fsdp_on_one_rank,
        )
        self.model_to_device()
        self._gradients = HeldGradients(module.parameters())
        if self.pipeline is not None:
            log_every_stage(module, self.pipeline)
            say_the_steps_that_do_not_run(module)
        self._prepared = module

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        if self.pipeline is None:  # through the module's own forward, so FSDP's root hooks run
            with self.precision_plugin.train_step_context():
                return self._forward_redirection(module, module, "training_step", *args, **kwargs)
        inputs, targets = split_batch(args[0])
        keep_outputs = step_hook(module, "training_step") is not None
        trainer, pipeline = module.trainer, self.pipeline
        window_start = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        step = partial(pipeline.train_step, inputs, targets, keep_outputs=keep_outputs, epoch_end=trainer.is_last_batch)
        with self.precision_plugin.train_step_context():
            result = self._gradients.hold(step, window_start=window_start)
        report_step(module, self.pipeline, step="training_step", result=result, targets=targets, step_args=args[1:])
        return result.loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        """Pipelined: add the gradients of this step's schedule (scaled for accumulation) instead of autograd."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._gradients.add(module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", *args, **kwargs)

    def _evaluate(self, step: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        with self.precision_plugin.val_step_context():
            if self.pipeline is None:
                with _resharded_after(module):
                    return self._forward_redirection(module, module, step, *args, **kwargs)
            inputs, targets = split_batch(args[0])
            keep_outputs = step_hook(module, step) is not None
            result = self.pipeline.eval_step(inputs, targets, keep_outputs=keep_outputs)
        report_step(module, self.pipeline, step=step, result=result, targets=targets, step_args=args[1:])
        return result.loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined: the last stage's outputs for the batch's inputs; None on the other stages."""
        if self.pipeline is None:
            with _resharded_after(self.lightning_module):
                return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self.pipeline.predict_step(prediction_inputs(args[0]))

    def gather_predictions(self, predictions: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Every DP replica's predictions as one tensor in the predict DataLoader's order (keep shuffle off), on every
        rank: call it on every rank with what `trainer.predict` returned there (`pipeline.gather_replica_outputs`)."""
        return gather_replica_outputs(self._require_plan(), predictions)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        pp_group = self.plan_mesh.pp_group if self.pipeline is not None and self.plan_mesh else None
        copies = self.pipeline.tied.duplicates if self.pipeline is not None and self.pipeline.tied else set()
        clip_grad_norm_(params, clip_val, pp_group, self.root_device, uncounted=copies)

    def save_hf(self, directory: str | Path) -> None:
        """Write the trained model as a Hugging Face directory (`AutoModelForCausalLM.from_pretrained` loads it; a
        peft model's adapter, which `PeftModel.from_pretrained` loads); call it on every rank, after `fit`. Each stage
        writes its layers' tensors, tied weights once."""
        assert self.lightning_module is not None and self.plan_mesh is not None
        save_pretrained(
            self.lightning_module, Path(self.broadcast(str(directory))), plan=self._require_plan(), mesh=self.plan_mesh
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state = checkpoint.model_state(self.lightning_module)
        return state if self.checkpoint_frozen else frozen.split(state, self.lightning_module)[0]

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return checkpoint.optimizer_state(self.lightning_module, optimizer)

    def save_checkpoint(self, checkpoint_: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("HolmesStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP")
        path = Path(self.broadcast(filepath))
        made_for = None if self._made_for is None else self._made_for.to_dict()
        if self.diloco is not None:
            self.diloco.flush()  # a streamed all-reduce in flight lands first, so the resume has nothing pending
        extra = {} if self.diloco is None else {"diloco": self.diloco.state_dict()}
        extra |= averaging.sharded_states(checkpoint_)
        left_out = None
        if not self.checkpoint_frozen:
            assert self.lightning_module is not None
            left_out = frozen.split(checkpoint.model_state(self.lightning_module), self.lightning_module)[1]
        checkpoint.save(
            checkpoint_,
            path,
            plan=self._require_plan(),
            rank=self.global_rank,
            made_for=made_for,
            extra=extra,
            left_out=left_out,
        )

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        extra = {} if self.diloco is None else {"diloco": self.diloco.state_dict()}
        callbacks = self.lightning_module.trainer.callbacks
        model_state = checkpoint.model_state(self.lightning_module)
        state, self._resumed_rng = checkpoint.load(
            path,
            self.lightning_module,
            optimizers,
            plan=self._require_plan(),
            rank=self.global_rank,
            strict=strict,
            extra=extra,
            optional=averaging.templates(callbacks, model_state),
        )
        averaging.restore(state, model_state)
        return state

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            checkpoint.remove(Path(filepath))

    def process_dataloader(self, dataloader: object) -> object:
        """Training data resumes mid-epoch where the checkpoint left it (Lightning alone restarts the epoch)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return resume.resumable(dataloader, trainer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first step after a resume draws the random numbers the interrupted run would have drawn."""
        if self._resumed_rng is not None:
            _set_rng_states(self._resumed_rng)
            self._resumed_rng = None
        super().on_train_batch_start(batch, batch_idx)
