"""`HolmesStrategy`: Lightning training on a Holmes Plan, pipeline stages over NIC groups with FSDP2 inside each.

Flow: `setup_environment` joins the processes and agrees on the Topology. `setup` (after the DataModule's `setup` and
the model's `configure_model`, so layers built there are planned too) has rank 0 profile the model and plan, shares
the Plan, creates its process groups and ("pp", "dp") mesh, and every rank keeps only its stage's layers, shards them
over its stage's DP group, allocates them if they were built on the meta device (`runtime.materialize`) and runs
torch.distributed.pipelining's schedule. With automatic optimisation Lightning calls training_step,
zero_grad, then backward: the schedule runs in training_step (so the real loss reaches Lightning) with its gradients
set aside, and backward adds them, which keeps accumulation, clipping, hooks and optimizer steps Lightning's own.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

import holmes_lightning.runtime.checkpoint as checkpoint
import holmes_lightning.runtime.nccl as nccl
import holmes_lightning.runtime.resume as resume
from holmes_lightning import calibration, planner
from holmes_lightning.calibration import Calibration, Handoff, handoff, step_collectives_s
from holmes_lightning.measure import available_cores, first_sample, profile_modules, rank_share
from holmes_lightning.planner import SCHEDULES, BatchSettings, LayerProfile, ModelProfile, Plan, PlanOptions, Sharding
from holmes_lightning.planner.planner import LAYOUTS, SHARDINGS
from holmes_lightning.planner.report import format_plan
from holmes_lightning.processes import launched_topology
from holmes_lightning.runtime.environment import LAB_BANDWIDTH_SCALE_ENV, NICGroupingEnvironment
from holmes_lightning.runtime.groups import PlanMesh, build_mesh
from holmes_lightning.runtime.hooks import report_step, step_hook
from holmes_lightning.runtime.materialize import is_meta, materialize, meta_twins
from holmes_lightning.runtime.pipeline import (
    Pipeline,
    check_contract,
    keep_owned_layers,
    missing_contract,
    prediction_inputs,
    split_batch,
)
from holmes_lightning.runtime.placement import choose_device, describe_emulation, host_position
from holmes_lightning.runtime.preemption import HolmesCheckpoint
from holmes_lightning.runtime.sharding import clip_grad_norm_, parallelize
from holmes_lightning.topology import ClusterSpec, Topology, load_cluster_spec

NOT_YET = "is made in setup, after the DataModule's setup and configure_model: read it from train_dataloader() or later"
LOOPS = {
    TrainerFn.FITTING: ("fit_loop", "train_dataloader"),
    TrainerFn.VALIDATING: ("validate_loop", "val_dataloader"),
    TrainerFn.TESTING: ("test_loop", "test_dataloader"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_dataloader"),
}


class HolmesStrategy(ModelParallelStrategy):
    """Pipeline x FSDP2 over the NIC groups of `cluster`, on the Plan the Holmes planner picks (or the one given).

    Arguments:
        cluster: a shipped config name, a YAML path, a dict, a ClusterSpec or a Topology; None: the launched nodes,
            NIC kinds detected.
        global_batch: samples per optimizer step over all DP replicas; the train DataLoader then gives
            `replica_batch_size` samples per step. microbatches: per step and replica; None lets the planner choose.
        options: every plan setting (`holmes_lightning.planner.PlanOptions`: degrees, schedule, partition, layout,
            sharding, cost-model knobs such as `memory_limit_gb`); the same object train.py and the plan CLI take.
        schedule, partition, pp, dp, sharding, layout: shorthands that override the same fields of `options`.
            layout="nic_unaware" is Megatron's rank order with IB and RoCE on TCP. sharding: "fsdp" (FSDP2 inside
            each stage), "none" (full replicas, gradients all-reduced) or "auto" (the planner's pick for this
            backend: FSDP unless replicas are faster, as on gloo, whose reduce-scatter costs a whole all-reduce).
            A given plan= brings its own.
        plan: a Plan (or its JSON file) to run instead of planning.
        profile: the model's cost profile; default: `pipeline_layers()` measured on `example_input_array`, or
            without it on one sample of the running entry point's DataLoader (meta layers: on meta tensors).
        calibrate: before planning, measure this machine on the model (`holmes_lightning.calibration`: the device's
            speed on its layers, the fixed cost per layer, FSDP2's hooks, the optimizer step, and a message between
            two ranks; each distinct layer for 1.5 s, `$HOLMES_CALIBRATION_SECONDS`), cached per machine and model
            shape, so the plan and its printed prediction are this machine's; `strategy.calibration` keeps what was
            measured. False: plan with `options` as given (the cluster config's TFLOPS x `efficiency`). Not with
            plan= or without `pipeline_layers()`.
        timeout: seconds (or a timedelta) a collective may wait before the job fails.
    """

    strategy_name = "holmes"

    def __init__(
        self,
        cluster: str | Path | dict | ClusterSpec | Topology | None = None,
        *,
        global_batch: int | None = None,
        microbatches: int | None = None,
        options: PlanOptions | None = None,
        schedule: str | None = None,
        partition: str | Sequence[int] | None = None,
        pp: int | None = None,
        dp: int | None = None,
        sharding: Sharding | str | None = None,
        layout: str | None = None,
        plan: Plan | str | Path | None = None,
        profile: ModelProfile | None = None,
        calibrate: bool = True,
        timeout: float | timedelta = default_pg_timeout,
        process_group_backend: str | None = None,
    ) -> None:
        given = {"schedule": schedule, "partition": partition, "pp": pp, "dp": dp, "sharding": sharding}
        given["layout"] = layout
        self.options = replace(options or PlanOptions(), **{k: v for k, v in given.items() if v is not None})
        _check_arguments(self.options, microbatches=microbatches, global_batch=global_batch)
        self.options.sharding = Sharding(self.options.sharding)
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
        self.batch = None if global_batch is None else BatchSettings(global_batch, microbatches)
        self.profile = profile
        self.calibrate = calibrate
        self.calibration: Calibration | None = None
        self.plan: Plan | None = (
            plan if isinstance(plan, Plan) or plan is None else Plan.from_json(Path(plan).read_text())
        )
        self.topology: Topology | None = None
        self.plan_mesh: PlanMesh | None = None
        self.pipeline: Pipeline | None = None
        self._prepared: nn.Module | None = None
        self._profiling = False
        self._parameters: list[nn.Parameter] = []
        self._step_grads: list[torch.Tensor | None] | None = None
        self._resumed_rng: dict[str, Any] | None = None
        self._device: torch.device | None = None

    @property
    def replica_batch_size(self) -> int:
        """Samples per training step that each DP replica's DataLoader must yield (global batch / dp).

        1 while the strategy reads one sample of a DataLoader to profile the model, before there is a plan.
        """
        if self._profiling:
            return 1
        return self._require_plan().replica_batch

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over the DP dimension only: every stage of one DP column sees the same batch."""
        if self.plan_mesh is None:
            raise RuntimeError(f"HolmesStrategy: the data split (DP degree) {NOT_YET}")
        return {"num_replicas": self._require_plan().dp, "rank": self.plan_mesh.dp_index}

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
                _check_automatic_optimization(model, f"pp={self.options.pp}")
        super().connect(model)

    @property
    @override
    def precision_plugin(self) -> Precision:
        return ModelParallelStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning hands the precision over in Trainer(), before any process starts: refuse fp16 with loss scaling."""
        if plugin is not None and plugin.precision == "16-mixed":
            raise ValueError(
                "HolmesStrategy cannot train with precision='16-mixed': its GradScaler is not sharding-aware (each "
                "FSDP shard and pipeline stage would check for inf/NaN and skip steps on its own); use "
                "precision='bf16-mixed' (no loss scaling needed) or '32-true'"
            )
        ModelParallelStrategy.precision_plugin.fset(self, plugin)

    @override
    def _configure_launcher(self) -> None:
        """Lightning has chosen the launcher's environment by now: wrap it so it also yields the Topology, and stop a
        launch of the wrong size here, before Lightning's launcher starts any process."""
        if not isinstance(self.cluster_environment, NICGroupingEnvironment):
            self.cluster_environment = NICGroupingEnvironment(self._cluster_source(), inner=self.cluster_environment)
        spawned_here = not self.cluster_environment.creates_processes_externally
        self.cluster_environment.check_launch((self.num_processes, self.num_nodes) if spawned_here else None)
        super()._configure_launcher()

    def _cluster_source(self) -> str | Path | dict | ClusterSpec | Topology:
        """holmes-launch's cluster (command-line overrides win over the script's), the given one, or the launch's."""
        launched = launched_topology()
        if launched is not None:
            given = self.cluster.spec if isinstance(self.cluster, Topology) else self.cluster
            if given is not None and load_cluster_spec(given) != launched.spec:
                rank_zero_info(
                    f"HolmesStrategy: running the cluster holmes-launch started ({launched.name!r}, "
                    f"{launched.world_size} ranks, command-line overrides included) instead of cluster={self.cluster!r}"
                )
            return launched
        if self.cluster is not None:
            return self.cluster
        nodes = [{"name": "local", "nodes": self.num_nodes, "nic": {"kind": None}}]
        return {"name": "launched", "devices_per_node": self.num_processes, "clusters": nodes}

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
        """The default group. On NCCL, this process's NCCL environment first (NCCL reads it once); the default
        group runs on sockets unless the config puts every node on one fabric (it carries only small messages)."""
        ParallelStrategy.setup_environment(self)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self._process_group_backend == "nccl":
            environment = self.cluster_environment
            assert isinstance(environment, NICGroupingEnvironment)
            rendezvous = (environment.main_address, environment.main_port)
            settings = nccl.set_up_process(
                environment.spec, environment.node_rank(), environment.node_address, rendezvous
            )
            if environment.local_rank() == 0 and settings.notes():
                print(f"holmes: node {environment.node_rank()}: {'; '.join(settings.notes())}", flush=True)
            options = torch.distributed.ProcessGroupNCCL.Options()
            net = nccl.group_net(nccl.world_link(environment.spec), os.environ)
            if net is not None:
                options.config.net_name = net
            kwargs.update(device_id=self.root_device, pg_options=options)
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def _plan_and_build_mesh(self, trainer: pl.Trainer) -> None:
        """The plan (made once per strategy, so fit and a later validate share it), its process groups and mesh."""
        if self.plan_mesh is None:
            self.plan = self._agree_on_plan(trainer)
            assert isinstance(self.cluster_environment, NICGroupingEnvironment)
            self.plan_mesh = build_mesh(
                self.plan,
                environment=self.cluster_environment,
                device=self.root_device,
                backend=self._get_process_group_backend(),
                timeout=self._timeout,
            )
        self._device_mesh = self.plan_mesh.mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _agree_on_plan(self, trainer: pl.Trainer) -> Plan:
        """Rank 0 profiles the model once, calibrates this machine on it and plans (or checks the given plan); every
        rank gets the plan and the calibration, or the error.

        Calibrating takes every rank first: they time a message between two of them while all compute (its latency
        and CPU) and the step's closing collectives, and make the group of rank 0 alone that FSDP is timed on.
        """
        assert self.lightning_module is not None
        calibrating = self.calibrate and self.plan is None and not missing_contract(self.lightning_module)
        message = handoff(self.root_device) if calibrating else Handoff(0.0, 0.0)
        closing = step_collectives_s(self.root_device, _step_collectives(trainer)) if calibrating else None
        alone = dist.new_group([0]) if calibrating else None
        outcome: tuple[str, str, dict | None] | Exception | None = None
        if self.global_rank == 0:
            try:
                sample = self._sample(trainer)
                profile = self._profile(sample)
                calibrated = None
                if self.plan is not None:
                    chosen = self._check_given_plan(self.plan)
                else:
                    if calibrating and sample is not None:
                        calibrated = self._calibrate(sample, profile, latency_s=message.latency_s, group=alone)
                        calibrated = replace(calibrated, closing_s=closing, message_cpu_s=message.cpu_s, **_lab_links())
                    chosen = self._make_plan(profile, calibrated)
                described = format_plan(chosen, profile)
                if calibrated is not None:
                    described += f"\n  calibrated: {calibrated.describe()}"
                outcome = (chosen.to_json(), described, None if calibrated is None else asdict(calibrated))
            except Exception as error:  # any failure must reach the other ranks, or they wait for the plan forever
                outcome = error
        outcome = self.broadcast(outcome)
        if alone is not None and self.global_rank == 0:
            dist.destroy_process_group(alone)
        if isinstance(outcome, Exception):
            raise outcome
        plan_json, description, calibrated = outcome
        self.calibration = None if calibrated is None else Calibration(**calibrated)
        rank_zero_info(description)
        return Plan.from_json(plan_json)

    def _sample(self, trainer: pl.Trainer) -> torch.Tensor | None:
        """One sample's inputs (samples first) to profile and time `pipeline_layers()` on: `example_input_array`, else
        one of the running entry point's DataLoader; None without pipeline layers or with a given profile.

        The random state is left as it was, so rank 0 draws the same numbers afterwards as the ranks that did not.
        """
        module = self.lightning_module
        assert module is not None
        if missing_contract(module) or (self.profile is not None and not self.calibrate):
            return None
        if torch.is_tensor(module.example_input_array):
            return module.example_input_array
        states = _collect_rng_states()
        self._profiling = True
        try:
            return _sample_inputs(trainer, type(module).__name__)
        finally:
            self._profiling = False
            _set_rng_states(states)

    def _profile(self, sample: torch.Tensor | None) -> ModelProfile:
        """The given profile, or `pipeline_layers()` measured on `sample` (one layer without them)."""
        module = self.lightning_module
        assert module is not None
        if self.profile is not None:
            return self.profile
        if sample is None:
            param_bytes = float(sum(p.numel() * p.element_size() for p in module.parameters()))
            return ModelProfile(type(module).__name__, (LayerProfile("model", 0.0, 0.0, param_bytes, 0.0, 0.0),), 1)
        states = _collect_rng_states()
        try:
            return profile_modules(module.pipeline_layers(), sample, name=type(module).__name__)
        finally:
            _set_rng_states(states)

    def _calibrate(
        self, sample: torch.Tensor, profile: ModelProfile, *, latency_s: float, group: dist.ProcessGroup | None
    ) -> Calibration:
        """This rank's costs on the model (`calibration.measure`, cached per machine and model shape). CPU ranks
        that all run on this host share its cores (the planner times that); spread over hosts, each is credited its
        share of its host's cores."""
        module = self.lightning_module
        assert module is not None
        measured = calibration.measure(module.pipeline_layers(), sample, device=self.root_device, group=group)
        if self.root_device.type != "cpu":
            return Calibration.of(measured, profile, share=1.0, latency_s=latency_s)
        host_ranks = host_position(os.environ, self.local_rank, self.num_processes)[1]
        if host_ranks == self.world_size:
            return Calibration.of(measured, profile, share=1.0, latency_s=latency_s, shared_cores=available_cores())
        return Calibration.of(measured, profile, share=rank_share(host_ranks), latency_s=latency_s)

    def _check_given_plan(self, given: Plan) -> Plan:
        assert self.topology is not None
        if len(given.pp_links) != given.dp:
            raise ValueError(
                f"plan= (version {given.version}) does not say which link each pipeline group uses (pp_links); plan "
                f"again with this version (holmes-plan ... plan.json=FILE, or HolmesStrategy without plan=)"
            )
        if given.world_size != self.topology.world_size:
            raise ValueError(
                f"plan= has {given.pp} stages x {given.dp} ranks = {given.world_size} ranks, but cluster "
                f"{self.topology.name!r} has {self.topology.world_size}; plan for this cluster"
            )
        return given

    def _make_plan(self, profile: ModelProfile, calibrated: Calibration | None) -> Plan:
        assert self.topology is not None and self.lightning_module is not None
        options = replace(self.options, backend=self._get_process_group_backend())
        topology = self.topology
        if calibrated is not None:  # compute as a fraction of the configured speed of rank 0's device
            options = calibrated.plan_options(options, peak_tflops=self.topology.node_of(0).device_tflops)
            topology = topology.at_link_scale(calibrated.bandwidth_scale)  # the lab's links, or as configured
        if missing_contract(self.lightning_module):  # pp=1: one FSDP group over every rank
            batch = self.batch or BatchSettings(self.topology.world_size)
            options = replace(options, layout="flat_fsdp", pp=None, dp=None, partition="auto")
            found = planner.plan(topology, profile, replace(batch, microbatches=None), options)
            return replace(found, notes=(*found.notes, "no pipeline contract (pipeline_layers): FSDP over all ranks"))
        if self.batch is None:
            raise ValueError(
                "HolmesStrategy(global_batch=None): the planner needs the samples per optimizer step; pass "
                "global_batch=<sequences per step over all DP replicas>"
            )
        return planner.plan(topology, profile, self.batch, options)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._plan_and_build_mesh(trainer)
        if self._prepared is not self.lightning_module:
            self._prepare(self.lightning_module)
        if self.pipeline is not None and trainer.state.fn == TrainerFn.FITTING:
            plan = self._require_plan()
            _check_automatic_optimization(self.lightning_module, f"{plan.num_virtual_stages} pipeline stages")
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
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # total norm over every stage

    def _prepare(self, module: pl.LightningModule) -> None:
        """Keep this stage's layers, shard them over the stage's DP mesh, allocate and initialise them if they are on
        the meta device, and build the stage's pipeline stages, in this order (torchtitan's)."""
        active_plan, mesh = self._require_plan(), self.plan_mesh
        assert mesh is not None
        self.model = self.precision_plugin.convert_module(self.model)
        mixed = self.precision_plugin.precision == "bf16-mixed"
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else MixedPrecisionPolicy()
        layers = [] if missing_contract(module) else list(module.pipeline_layers())
        if len(layers) not in (0, active_plan.num_layers):
            raise ValueError(
                f"the plan splits {active_plan.num_layers} layers but {type(module).__name__}.pipeline_layers() "
                f"returns {len(layers)}; plan for this model"
            )
        stage = active_plan.stages[mesh.stage]
        owned = stage.layers if active_plan.is_pipelined else range(len(layers))
        if active_plan.is_pipelined:
            check_contract(module, active_plan.pp)
            keep_owned_layers(module, layers, set(owned))
            module.example_input_array = None  # the whole forward no longer runs here (model summary would call it)
        twins = meta_twins(layers, owned) if layers and is_meta(module) else {}
        if not active_plan.is_pipelined:  # FSDP2 or replicas only: the module's own training_step runs
            parallelize(module, layers=layers, mesh=mesh.dp_mesh, plan=active_plan, mp_policy=policy)
            self._materialize(module, layers, twins)
        else:  # virtual stages, possibly all on this rank (pp=1, Interleaved1F1B)
            chunks = [nn.Sequential(*layers[start:stop]) for start, stop in stage.chunks]
            syncs = [
                parallelize(chunk, layers=list(chunk), mesh=mesh.dp_mesh, plan=active_plan, mp_policy=policy)
                for chunk in chunks
            ]
            self._materialize(module, layers, twins)
            self.pipeline = Pipeline(
                plan=active_plan,
                stage=mesh.stage,
                chunks=chunks,
                pp_group=mesh.pp_group,
                device=self.root_device,
                loss_fn=module.pipeline_loss,
                gradient_syncs=[sync for sync in syncs if sync is not None],
                hop_groups=mesh.hop_groups,
            )
        self.model_to_device()
        self._parameters = list(module.parameters())
        self._prepared = module

    def _materialize(self, module: pl.LightningModule, layers: list[nn.Module], twins: dict[int, nn.Module]) -> None:
        """Meta layers: this rank's shards, each layer initialised from its own seed (rank 0's) as on one process.

        A meta model without `pipeline_layers()` gets Lightning's treatment: each submodule's `reset_parameters()`.
        """
        if twins:
            seed = self.broadcast(torch.initial_seed())
            materialize(module, layers=layers, twins=twins, device=self.root_device, seed=seed)
        else:
            _materialize_distributed_module(module, self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        if self.pipeline is None:  # through the module's own forward, so FSDP's root hooks run
            with self.precision_plugin.train_step_context():
                return self._forward_redirection(module, module, "training_step", *args, **kwargs)
        inputs, targets = split_batch(args[0])
        keep_outputs = step_hook(module, "training_step") is not None
        trainer = module.trainer
        if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0:
            for param in self._parameters:  # Lightning zeroes them right after this step: free them before it runs
                param.grad = None
        earlier = _swap_grads(self._parameters, [None] * len(self._parameters))
        with self.precision_plugin.train_step_context():
            result = self.pipeline.train_step(inputs, targets, keep_outputs=keep_outputs)
        self._step_grads = _swap_grads(self._parameters, earlier)
        report_step(module, self.pipeline, step="training_step", result=result, targets=targets, step_args=args[1:])
        return result.loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        """Pipelined: add the gradients of this step's schedule (scaled for accumulation) instead of autograd."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None and self._step_grads is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        accumulate = module.trainer.accumulate_grad_batches
        for param, grad in zip(self._parameters, self._step_grads, strict=True):
            if grad is None:
                continue
            if accumulate > 1:
                grad.div_(accumulate)
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._step_grads = None
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
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self.pipeline.predict_step(prediction_inputs(args[0]))

    def gather_predictions(self, predictions: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The predictions of every DP replica as one tensor in the predict DataLoader's order, on every rank.

        Call it on every rank with what `trainer.predict` returned there (per batch: the last stage's outputs on its
        ranks, None on the other stages). Lightning's predict sampler gives DP replica d the samples d, d + dp, ...
        of the DataLoader's order (keep shuffle off), so the replicas' rows interleave back.
        """
        plan = self._require_plan()
        everyone: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, list(predictions))
        last = next(stage for stage in plan.stages if plan.holds_last(stage.index))
        replicas = [torch.cat(everyone[rank]) for rank in last.ranks]
        merged = replicas[0].new_empty((sum(len(rows) for rows in replicas), *replicas[0].shape[1:]))
        for index, rows in enumerate(replicas):
            merged[index :: len(replicas)] = rows
        return merged

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        pp_group = self.plan_mesh.pp_group if self.pipeline is not None and self.plan_mesh else None
        clip_grad_norm_(params, clip_val, pp_group, self.root_device)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return checkpoint.model_state(self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return checkpoint.optimizer_state(self.lightning_module, optimizer)

    def save_checkpoint(self, checkpoint_: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("HolmesStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP")
        path = Path(self.broadcast(filepath))
        checkpoint.save(checkpoint_, path, plan=self._require_plan(), rank=self.global_rank)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        state, self._resumed_rng = checkpoint.load(
            path, self.lightning_module, optimizers, plan=self._require_plan(), rank=self.global_rank, strict=strict
        )
        return state

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            checkpoint.remove(Path(filepath))

    def process_dataloader(self, dataloader: object) -> object:
        """Training data resumes mid-epoch where the checkpoint left it (Lightning alone restarts the epoch)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return resume.resumable(dataloader, trainer) if trainer is not None and trainer.training else dataloader

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first step after a resume draws the random numbers the interrupted run would have drawn."""
        if self._resumed_rng is not None:
            _set_rng_states(self._resumed_rng)
            self._resumed_rng = None
        super().on_train_batch_start(batch, batch_idx)


def _lab_links() -> dict[str, Any]:
    """Inside the lab (`holmes_lightning.lab`), which runs every link at its speed x a scale: that scale, so the plan
    is made for the links the job has; elsewhere nothing."""
    scale = os.environ.get(LAB_BANDWIDTH_SCALE_ENV)
    if scale is None:
        return {}
    return {"bandwidth_scale": float(scale), "scale_reason": f"the lab's links, ${LAB_BANDWIDTH_SCALE_ENV}"}


def _step_collectives(trainer: pl.Trainer) -> int:
    """The small collectives over every rank a pipelined training step runs after its schedule: the loss's
    all-reduce, the training loop's broadcast of rank 0's stop signal (Lightning 2.5+), the clipping norm's
    all-reduce, each HolmesCheckpoint's stop vote."""
    count = 1 + hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")
    count += bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")
    return count + sum(isinstance(callback, HolmesCheckpoint) for callback in trainer.callbacks)


def _sample_inputs(trainer: pl.Trainer, model_name: str) -> torch.Tensor:
    """The inputs of one sample of the DataLoader the running entry point (fit, validate, test, predict) reads."""
    loop, hook = LOOPS[trainer.state.fn]
    source = getattr(trainer, loop)._data_source
    fix = (
        f"set `self.example_input_array = <inputs of one batch, samples first>` in {model_name}.__init__, or pass "
        f"HolmesStrategy(profile=...)"
    )
    if not source.is_defined():
        raise ValueError(f"HolmesStrategy profiles pipeline_layers() on one sample, but there is no {hook}(); {fix}")
    try:
        loaders = source.dataloader()
    except RuntimeError as error:
        raise RuntimeError(
            f"HolmesStrategy reads one sample of {hook}() to profile the model before it plans, and that failed: "
            f"{error}; {fix}"
        ) from error
    while isinstance(loaders, list | tuple | dict):  # several loaders: the first one's
        loaders = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0]
    batch = first_sample(loaders)
    return prediction_inputs(batch) if trainer.state.fn == TrainerFn.PREDICTING else split_batch(batch)[0]


def _swap_grads(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Put `grads` into `params` and return what they held."""
    held = [p.grad for p in params]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    return held


def _check_automatic_optimization(module: pl.LightningModule, pipeline: str) -> None:
    if not module.automatic_optimization:
        raise ValueError(
            f"HolmesStrategy with {pipeline} needs Lightning's automatic optimization: the pipeline schedule runs "
            f"forward and backward itself, and Lightning steps the optimizers, clips and accumulates around it; remove "
            f"`self.automatic_optimization = False` from {type(module).__name__} (and its manual optimizer calls), "
            f"or train without a pipeline: HolmesStrategy(pp=1) with a schedule that is not interleaved"
        )


def _check_arguments(options: PlanOptions, **counts: int | None) -> None:
    """What HolmesStrategy can reject before any process starts."""
    if options.schedule not in SCHEDULES:
        raise ValueError(f"HolmesStrategy(schedule={options.schedule!r}): use one of {', '.join(SCHEDULES)}")
    if options.sharding not in SHARDINGS:
        raise ValueError(f"HolmesStrategy(sharding={options.sharding!r}): use one of {', '.join(SHARDINGS)}")
    if options.layout not in LAYOUTS:
        raise ValueError(f"HolmesStrategy(layout={options.layout!r}): use one of {', '.join(LAYOUTS)}")
    counts.update(pp=options.pp, dp=options.dp)
    for name, value in counts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"HolmesStrategy({name}={value!r}): use a positive integer, or None to let the planner pick"
            )


StrategyRegistry.register(
    "holmes", HolmesStrategy, description="Holmes: pipeline stages over NIC groups, FSDP2 inside each stage"
)
