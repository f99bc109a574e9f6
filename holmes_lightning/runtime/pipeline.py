"""The model contract, this rank's pipeline stages built from a Plan, and one schedule step over them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class

from holmes_lightning.measure.layer_io import Kept, buffer_values, restore_buffers
from holmes_lightning.planner import Plan
from holmes_lightning.planner.schedules import microbatch_problem
from holmes_lightning.runtime.contract import Inputs, LossWeight
from holmes_lightning.runtime.sharding import GradientSync, fsdp_modules
from holmes_lightning.runtime.ties import TiedCopies

T = TypeVar("T")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# the schedule of a placement that takes any micro-batch count, by (V placement, several chunks per stage)
_ANY_COUNT = {(False, False): "GPipe", (False, True): "LoopedBFS", (True, True): "ZBVZeroBubble"}
_SCHEDULES_KEPT = 8  # a schedule holds receive buffers of its micro-batches' activations (and gradients)


class LayerChain(nn.Sequential):
    """A stage's run of pipeline layers: each gets the previous one's output, a tuple as several arguments."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        flow: torch.Tensor | tuple[torch.Tensor, ...] = inputs
        for layer in self:
            flow = layer(*flow) if isinstance(flow, tuple) else layer(flow)
        return flow


@dataclass(frozen=True)
class StepResult:
    """One pipelined step: the mean loss over all DP replicas (every rank), and the last stage's outputs for the
    replica batch where they were asked for (None on other stages, and when not asked)."""

    loss: torch.Tensor
    outputs: torch.Tensor | None


@dataclass(frozen=True)
class BuiltSchedule:
    """A torch schedule, the PipelineStages it runs (a step leaves activations and outputs in them), and whether it
    trains (runs backward) or only runs forward."""

    runner: PipelineScheduleSingle | PipelineScheduleMulti
    stages: list[PipelineStage]
    trains: bool


class HopStage(PipelineStage):
    """A PipelineStage whose activations and gradients to a neighbour travel in that pair's own group when it has one
    (`groups.hop_groups`: the hop's fabric); shape exchange and everything else stay on the pipeline group."""

    def __init__(
        self,
        chunk: nn.Module,
        index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        hop_groups: Mapping[int, dist.ProcessGroup],
    ) -> None:
        super().__init__(chunk, index, num_stages, device, group=group)
        self.hop_groups = hop_groups
        self.kept_buffers: Kept = []  # during torch's metadata inference

    def _to_tensor(self, arg: object) -> torch.Tensor:
        """Metadata inference runs this stage's forward on empty tensors of the shapes it received (torch 2.13): the
        integer ones (token and position ids, masks) are zeroed, so a layer that looks a table up by them (GPT-J's
        rotary sin/cos by position id) indexes it, not whatever the memory held."""
        tensor = super()._to_tensor(arg)
        if isinstance(arg, torch.Tensor) or tensor.is_floating_point() or tensor.is_complex():
            return tensor
        return tensor.zero_()

    def _forward_metadata_inference(self, *args: object, **kwargs: object) -> object:
        """Torch's shape inference runs the forward (and backward) in training mode on empty tensors: the buffers
        are kept before it and set back after it (`_post_metadata_inference_cleanup`), so that running statistics
        (BatchNorm's) are not updated from what the memory held."""
        self.kept_buffers = buffer_values([self.submod])
        return super()._forward_metadata_inference(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        restore_buffers(self.kept_buffers)
        self.kept_buffers = []

    def _on_hop_groups(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        return [
            dist.P2POp(op.op, op.tensor, op.peer, self.hop_groups[op.peer], op.tag)
            if op.peer in self.hop_groups
            else op
            for op in ops
        ]

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._on_hop_groups(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._on_hop_groups(super().get_bwd_recv_ops(bwd_chunk_id))

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._on_hop_groups(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._on_hop_groups(super().get_bwd_send_ops(bwd_chunk_id))

    def get_local_bwd_output(self, mb_index: int) -> tuple[torch.Tensor | None, ...]:
        """The input gradients handed to the virtual stage before on this rank (a V schedule's turn); none in an
        evaluation, where torch's runtime still hands them over."""
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict] | None]:
        """Torch's split backward (zero-bubble and V schedules) finds a stage's weight gradients through its inputs'
        (torch 2.13, `stage_backward_input`), and runs the whole backward in the weight pass instead only for stage 0,
        whose inputs need no gradient. A later stage whose inputs need none either (every layer before it frozen)
        got no weight gradients at all; its input pass is skipped here, as stage 0's is, and its weight pass runs the
        whole backward (`backward_weight_one_chunk`)."""
        if backward_type == "input" and not _requires_grad(bwd_kwargs["input_values"]):
            return tuple(None for _ in bwd_kwargs["input_values"]), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        state = self.backward_state.get(bwd_chunk_id) if self.stage_index != 0 else None
        if state is None or state[1] is not None:  # the input pass gave the weights' parameter groups
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
            return
        input_values, _, stage_output, output_grads = self.backward_state.pop(bwd_chunk_id)
        self.dw_runner.pop(bwd_chunk_id)
        whole = {"stage_output": stage_output, "output_grads": output_grads, "input_values": input_values}
        self.backward_maybe_with_nosync("full", whole, last_backward=last_backward)


def _requires_grad(values: Sequence[object]) -> bool:
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in values)


class Pipeline:
    """This rank's chunks as PipelineStages and the plan's schedule; one schedule per micro-batch shape for eval.

    The chunks come parallelized (`sharding.parallelize`); `gradient_syncs` are what it left to run after each
    schedule step (the gradient averaging of pipelined replicas, then the gradient sum of `tied`, this rank's copies
    of weights tied across stages). The last stage's outputs (logits: GBs at a real
    vocabulary x sequence) are kept only for a step that asks for them (`keep_outputs`), and nothing a step computed
    stays in the stages after it. With `loss_weight` (the module's `pipeline_loss_weight`) each micro-batch's loss
    counts by its weight over the weights of the whole global batch (summed over `dp_group`, the replicas of this
    stage): the step's loss and gradients are those of the global batch's mean over its counted units.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        stage: int,
        chunks: Sequence[nn.Module],
        pp_group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: LossFn,
        loss_weight: LossWeight | None = None,
        dp_group: dist.ProcessGroup | None = None,
        gradient_syncs: Sequence[GradientSync] = (),
        hop_groups: Mapping[int, dist.ProcessGroup] | None = None,
        tied: TiedCopies | None = None,
    ) -> None:
        self.plan = plan
        self.stage = stage
        self.chunks = list(chunks)
        self.pp_group = pp_group
        self.hop_groups = dict(hop_groups or {})
        self.device = device
        self.loss_fn = loss_fn
        self.loss_weight = loss_weight
        self.dp_group = dp_group
        self.gradient_syncs = list(gradient_syncs)
        self.tied = tied
        self.fsdp_modules = [m for chunk in self.chunks for m in fsdp_modules(chunk)]
        self._schedules: OrderedDict[tuple[object, ...], BuiltSchedule] = OrderedDict()  # latest used last
        self.on_schedule_built: list[Callable[[BuiltSchedule], None]] = []  # called with each, before its first step
        self._weight_scale: torch.Tensor | None = None  # micro-batches x replicas / the global batch's weight
        self._compared: set[str] = set()  # the kinds of batch whose first one the pipeline's ranks compared
        self._trained: frozenset[str] | None = None  # the parameters that required gradients at the first step

    @property
    def is_first(self) -> bool:
        return self.plan.holds_first(self.stage)

    @property
    def is_last(self) -> bool:
        return self.plan.holds_last(self.stage)

    @property
    def last_stage(self) -> int:
        """The stage that runs the last virtual stage: its rank in the pipeline group (groups follow stage order)."""
        return next(stage for stage in range(self.plan.pp) if self.plan.holds_last(stage))

    def _schedule(self, inputs: Inputs, *, microbatches: int, with_loss: bool, backward: bool) -> BuiltSchedule:
        """The schedule for batches of these shapes in `microbatches`: the plan's, or where it would refuse that count
        (1F1B under pp micro-batches, ...: an epoch's short last batch) the one of the same stage placement that takes
        any (`_ANY_COUNT`). Stage buffers are sized by the first micro-batch a schedule sees, so each shape (padding to
        the longest sequence of a batch makes many) gets its own; the `_SCHEDULES_KEPT` used last are kept."""
        key = (backward, with_loss, microbatches, *(tuple(t.shape) for t in inputs))
        if key not in self._schedules:
            if len(self._schedules) == _SCHEDULES_KEPT:
                self._schedules.popitem(last=False)
            self._schedules[key] = self._new_schedule(microbatches, with_loss=with_loss, backward=backward)
            for callback in self.on_schedule_built:
                callback(self._schedules[key])
        self._schedules.move_to_end(key)
        return self._schedules[key]

    def _new_schedule(self, microbatches: int, *, with_loss: bool, backward: bool) -> BuiltSchedule:
        name = self.plan.schedule.value
        if microbatch_problem(self.plan.schedule, self.plan.pp, microbatches) is not None:
            name = _ANY_COUNT[self.plan.schedule.v_shaped, self.plan.chunks_per_stage > 1]
        schedule_class = get_schedule_class(name)
        virtual = self.plan.virtual_stages(self.stage)
        stages = [
            HopStage(chunk, index, self.plan.num_virtual_stages, self.device, self.pp_group, self.hop_groups)
            for index, chunk in zip(virtual, self.chunks, strict=True)
        ]
        single = issubclass(schedule_class, PipelineScheduleSingle)
        loss_fn = self._loss if with_loss else None
        runner = schedule_class(stages[0] if single else stages, n_microbatches=microbatches, loss_fn=loss_fn)
        return BuiltSchedule(runner, stages, trains=backward)

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss as the schedule backpropagates it: the module's, weighted where it weighs."""
        loss = self.loss_fn(outputs, targets)
        if self._weight_scale is None:
            return loss
        return loss * self.loss_weight(targets) * self._weight_scale

    def _weigh(self, targets: torch.Tensor | None, microbatches: int) -> None:
        """Before a step, on the last stage: what each micro-batch's weight counts for in the global batch."""
        self._weight_scale = None
        if self.loss_weight is None or targets is None or not self.is_last:
            return
        chunks = targets.to(self.device).chunk(microbatches)
        total = torch.stack([self.loss_weight(chunk).to(torch.float64) for chunk in chunks]).sum()
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        self._weight_scale = len(chunks) * self.plan.dp / total.clamp(min=1)

    def train_step(
        self, inputs: Inputs, targets: torch.Tensor, *, keep_outputs: bool = False, epoch_end: bool = False
    ) -> StepResult:
        """Forward and backward of one replica batch; gradients land in the stage's parameters. A shorter batch at
        an epoch's end (`epoch_end`: a DataLoader that keeps its last, partial batch) runs in the micro-batches that
        `Plan.training_microbatches` splits it into."""
        samples, plan = inputs[0].shape[0], self.plan
        if samples != plan.replica_batch and not (epoch_end and samples < plan.replica_batch):
            raise ValueError(
                f"a training batch has {samples} samples per DP replica: the plan needs {plan.microbatches} "
                f"micro-batches x {plan.microbatch_size} = {plan.replica_batch}; give the train DataLoader "
                f"batch_size=strategy.replica_batch_size (global batch / dp)"
            )
        microbatches = plan.training_microbatches(samples)
        self._compare_first("training", (*inputs, targets))
        self._check_trained_parameters()
        for module in self.fsdp_modules:  # every stage gathers now, not when its first micro-batch arrives
            module.unshard(async_op=True)  # FSDP's pre-forward waits for it
        self._weigh(targets, microbatches)
        schedule = self._schedule(inputs, microbatches=microbatches, with_loss=True, backward=True)
        local, outputs = self._run(schedule, inputs, targets, keep_outputs=keep_outputs, backward=True)
        for sync in self.gradient_syncs:
            sync()
        return StepResult(shared_loss(local, self.plan.dp, self.device), outputs)

    def eval_step(self, inputs: Inputs, targets: torch.Tensor, *, keep_outputs: bool = False) -> StepResult:
        """Forward only, of any batch size (`_forward`)."""
        self._compare_first("evaluation", (*inputs, targets))
        local, outputs = self._forward(inputs, targets, keep_outputs=keep_outputs)
        return StepResult(shared_loss(local, self.plan.dp, self.device), outputs)

    def predict_step(self, inputs: Inputs) -> torch.Tensor | None:
        """Forward only, no loss: the last stage's outputs (None on the other stages)."""
        return self._forward(inputs, None, keep_outputs=True)[1]

    def _check_trained_parameters(self) -> None:
        """Which parameters train is fixed at the first training step: torch's pipeline infers then which stage inputs
        and outputs carry gradients, for every step after. A layer frozen or unfrozen later (gradual unfreezing)
        failed in backward ("grad can be implicitly created only for scalar outputs") on another stage's ranks."""
        trained = frozenset(
            f"pipeline layer {start + int(index)}: {name}"
            for chunk, (start, _) in zip(self.chunks, self.plan.stages[self.stage].chunks, strict=True)
            for parameter_name, parameter in chunk.named_parameters()
            if parameter.requires_grad
            for index, _, name in [parameter_name.partition(".")]
        )
        if self._trained is None:
            self._trained = trained
        elif trained != self._trained:
            changed = sorted(trained ^ self._trained)
            raise RuntimeError(
                f"HolmesStrategy: requires_grad changed after the first training step for {len(changed)} "
                f"parameter(s) ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}): the pipeline fixes at "
                f"its first step which stage inputs and outputs carry gradients. Freeze or unfreeze before fit (or in "
                f"on_fit_start), or start a new fit from a checkpoint after the change"
            )

    def _compare_first(self, kind: str, batch: Sequence[torch.Tensor]) -> None:
        """On the first batch of a kind, that the pipeline's ranks all read it (`same_batch`)."""
        if kind not in self._compared and self.plan.pp > 1:
            same_batch(batch, self.pp_group, self.device, kind)
        self._compared.add(kind)

    def _forward(
        self, inputs: Inputs, targets: torch.Tensor | None, *, keep_outputs: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Forward only, in the first of `Plan.microbatch_counts` (the plan's micro-batches where they split the
        batch; else, e.g. for an epoch's short last batch, the fewest of at most the planned size)."""
        microbatches = self.plan.microbatch_counts(inputs[0].shape[0])[0]
        self._weigh(targets, microbatches)
        if self.plan.pp == 1:  # every virtual stage is here: run the chunks in order (torch's eval trips on this)
            result = self._run_locally(inputs, targets, microbatches=microbatches, keep_outputs=keep_outputs)
        else:
            schedule = self._schedule(inputs, microbatches=microbatches, with_loss=targets is not None, backward=False)
            result = self._run(schedule, inputs, targets, keep_outputs=keep_outputs)
        for module in self.fsdp_modules:
            module.reshard()  # no backward follows to free the gathered weights
        return result

    def _run(
        self,
        schedule: BuiltSchedule,
        inputs: Inputs,
        targets: torch.Tensor | None,
        *,
        keep_outputs: bool,
        backward: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One schedule call: the mean loss of this rank's micro-batches and the merged outputs (None off the last
        stage, or when not kept)."""
        losses: list[torch.Tensor] = []
        first = tuple(t.to(self.device) for t in inputs) if self.is_first else ()
        target = targets.to(self.device) if targets is not None and self.is_last else None
        call = schedule.runner.step if backward else schedule.runner.eval
        kept = losses if targets is not None else None  # prediction: no loss function, no losses
        outputs = call(*first, target=target, losses=kept, return_outputs=keep_outputs)
        for stage in schedule.stages:  # eval leaves every micro-batch's activations (logits) here until the next call
            stage.clear_runtime_states()
        return _mean(losses), outputs

    def _run_locally(
        self, inputs: Inputs, targets: torch.Tensor | None, *, microbatches: int, keep_outputs: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        losses, outputs = [], []
        target_chunks = targets.to(self.device).chunk(microbatches) if targets is not None else [None] * microbatches
        input_chunks = zip(*(t.to(self.device).chunk(microbatches) for t in inputs), strict=True)
        for x, y in zip(input_chunks, target_chunks, strict=True):
            for chunk in self.chunks:
                x = chunk(*x) if isinstance(x, tuple) else chunk(x)
            if y is not None:
                losses.append(self._loss(x, y))
            if keep_outputs:
                outputs.append(x)
        return _mean(losses), torch.cat(outputs) if outputs else None


class HeldGradients:
    """A pipelined step's gradients, held out of `params` from the schedule (run in `training_step`, before
    Lightning zeroes gradients) until Lightning's `backward` adds them, which keeps accumulation, clipping, hooks and
    optimizer steps Lightning's own."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.held: list[torch.Tensor | None] | None = None

    def hold(self, step: Callable[[], T], *, window_start: bool) -> T:
        """Run `step` on empty gradients and hold what it leaves. `window_start`: the first batch of an accumulation
        window, whose earlier gradients are freed first (Lightning zeroes them right after this step anyway)."""
        if window_start:
            for param in self.params:
                param.grad = None
        earlier = self._swap([None] * len(self.params))
        result = step()
        self.held = self._swap(earlier)
        return result

    def add(self, accumulate: int) -> None:
        """Add the held gradients to the parameters', each / `accumulate` (Lightning's gradient accumulation)."""
        assert self.held is not None, "backward without a pipelined training step before it"
        for param, grad in zip(self.params, self.held, strict=True):
            if grad is None:
                continue
            if accumulate > 1:
                grad.div_(accumulate)
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self.held = None

    def _swap(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Put `grads` into the parameters and return what they held."""
        held = [param.grad for param in self.params]
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad
        return held


def _mean(losses: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.stack([loss.detach().float() for loss in losses]).mean() if losses else None


def gather_replica_outputs(plan: Plan, outputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Every DP replica's last-stage `outputs` (per batch; None off the last stage) as one tensor on every rank, rows
    in the order of a DataLoader whose samples d, d + dp, ... went to replica d. Every rank calls it."""
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(outputs))
    last = next(stage for stage in plan.stages if plan.holds_last(stage.index))
    replicas = [torch.cat(everyone[rank]) for rank in last.ranks]
    merged = replicas[0].new_empty((sum(len(rows) for rows in replicas), *replicas[0].shape[1:]))
    for index, rows in enumerate(replicas):
        merged[index :: len(replicas)] = rows
    return merged


def same_batch(batch: Sequence[torch.Tensor], pp_group: dist.ProcessGroup, device: torch.device, kind: str) -> None:
    """Raise on every rank if the ranks of some pipeline (the stages of one DP replica) read different batches: its
    first stage would compute on one and its last stage take another's targets. Each rank's digest of its batch is
    gathered over its pipeline, then every rank learns whether any pipeline differs (a collective over all ranks)."""
    digest = torch.cat([_digest(tensor.to(device)) for tensor in batch])
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size(pp_group))]
    dist.all_gather(gathered, digest, group=pp_group)
    ranks = dist.get_process_group_ranks(pp_group)
    differ = [rank for rank, other in zip(ranks, gathered, strict=True) if not torch.equal(other, gathered[0])]
    flag = torch.tensor([float(bool(differ))], device=device, dtype=torch.float32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        where = f"ranks {differ} read other batches than rank {ranks[0]}, their first stage" if differ else "elsewhere"
        raise ValueError(
            f"the ranks of one pipeline read different {kind} batches ({where}): every stage of a DP replica must "
            f"read the same samples. Build the same data on every rank (seed what is random, e.g. "
            f"`L.seed_everything`) and split it by the DP replica, `DistributedSampler(dataset, "
            f"**trainer.strategy.distributed_sampler_kwargs)` (Lightning adds one to a map-style dataset by itself); "
            f"an IterableDataset takes its shard from the same num_replicas and rank, not the global rank"
        )


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    """Numbers that differ between two different batches in practice: the element count, sum and a weighted sum."""
    flat = tensor.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 1009 + 1
    count = torch.tensor(float(flat.numel()), device=flat.device, dtype=torch.float64)
    sums = torch.stack([count, flat.sum(), (flat * weights).sum()])
    return torch.nan_to_num(sums)


def shared_loss(local: torch.Tensor | None, dp: int, device: torch.device) -> torch.Tensor:
    """The mean loss over all DP replicas, on every rank: last-stage ranks contribute, the others add zero (in
    float32 on every rank, whatever the default dtype: `precision="bf16-true"` makes it bf16 off the last stage)."""
    total = local.float() / dp if local is not None else torch.zeros((), device=device, dtype=torch.float32)
    dist.all_reduce(total)
    return total
