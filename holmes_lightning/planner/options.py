"""What the user asks the planner for: `PlanOptions` and `BatchSettings`, checked when they are made.

Every choice is an enum (a `ConfigEnum`, so Hydra checks config values against it and strings still compare equal),
and every setting is checked in `__post_init__`: a bad one raises `SettingError` naming the field as the caller wrote
it (`PlanOptions(pp=0)`, `HolmesStrategy(pp=0)` or `strategy.pp=0`), before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum

from holmes_lightning.topology import ConfigEnum


class _ScheduleBase(ConfigEnum):
    @property
    def interleaved(self) -> bool:
        """Several model chunks per stage (virtual stages in loop placement)."""
        return self.value.startswith("Interleaved")

    @property
    def v_shaped(self) -> bool:
        """Two chunks per stage in V placement: stage s runs virtual stages s and 2 pp - 1 - s, so the model goes down
        the stages and back up, and the turn at the last stage stays on its rank (ZBVZeroBubble, DualPipeV)."""
        return self.value in ("ZBVZeroBubble", "DualPipeV")

    @property
    def chosen(self) -> bool:
        """`auto`: the planner runs every schedule it models and takes the best."""
        return self.value == "auto"

    @property
    def splits_backward(self) -> bool:
        """Each backward runs as an input-gradient pass, whose gradient goes down the pipeline at once, and a
        weight-gradient pass the schedule runs later, into what would be a bubble (the zero-bubble schedules; DualPipeV
        splits those of its last steps)."""
        return self.value.endswith("ZeroBubble") or self.value == "DualPipeV"


# torch's schedule names without `Schedule`; "1F1B" is no identifier, hence the functional form (Hydra matches names)
Schedule = _ScheduleBase(
    "Schedule",
    [
        (name, name)
        for name in (
            "GPipe",
            "1F1B",
            "Interleaved1F1B",
            "InterleavedZeroBubble",
            "ZBVZeroBubble",
            "DualPipeV",
            "auto",
        )
    ],
    module=__name__,
)
MODELLED_SCHEDULES = tuple(schedule for schedule in Schedule if not schedule.chosen)  # what `auto` chooses among


class LayoutKind(ConfigEnum):
    """How ranks are laid out: Holmes' NIC-aware order, Megatron-LM's rank order, or one FSDP group over all."""

    holmes = "holmes"
    nic_unaware = "nic_unaware"
    flat_fsdp = "flat_fsdp"


class Backend(ConfigEnum):
    """The collective library the job's process groups run on."""

    nccl = "nccl"
    gloo = "gloo"


class Sharding(ConfigEnum):
    """How a stage's DP group holds its parameters: FSDP2 shards, full replicas, or the planner's pick (`auto`)."""

    auto = "auto"
    fsdp = "fsdp"
    none = "none"


class Checkpointing(ConfigEnum):
    """Activation checkpointing: which pipeline layers keep only their input and run their forward again in backward.

    `full`: every layer; `selective`: every other one (odd positions); `auto`: per stage, off where the stage fits
    the memory bound keeping every activation, else selective, else full; `off`: none.
    """

    off = "off"
    full = "full"
    selective = "selective"
    auto = "auto"

    def recomputed(self, layers: int) -> tuple[bool, ...]:
        """Per pipeline layer: is it checkpointed under this (resolved, not `auto`) choice."""
        every = self is Checkpointing.full
        return tuple(every or (self is Checkpointing.selective and i % 2 == 1) for i in range(layers))


class PartitionRule(ConfigEnum):
    """Layers per stage chosen by the planner (`auto`: the lowest predicted step) or split equally (`uniform`)."""

    auto = "auto"
    uniform = "uniform"


Partition = PartitionRule | tuple[int, ...]  # a rule, or layers per stage (per virtual stage also accepted)


class SettingError(ValueError):
    """A setting that cannot work: the field as the caller wrote it, its value and the fix.

    `owner` is how the caller wrote the setting: a call (`"PlanOptions"` -> `PlanOptions(pp=0)`) or a config node
    ending in a dot (`"strategy."` -> `strategy.pp=0`); `as_written_in` renames it for another caller.
    """

    def __init__(self, owner: str, name: str, value: object, fix: str) -> None:
        self.owner, self.name, self.value, self.fix = owner, name, value, fix
        setting = f"{owner}{name}={value!r}" if owner.endswith(".") else f"{owner}({name}={value!r})"
        super().__init__(f"{setting}: {fix}")

    def as_written_in(self, owner: str) -> SettingError:
        return SettingError(owner, self.name, self.value, self.fix)


Check = tuple[Callable[[object], bool], str]  # what a value must satisfy, and the fix when it does not


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_or_none(value: object) -> bool:
    return value is None or _positive_int(value)


def check_fields(instance: object, checks: dict[str, Check]) -> None:
    """Raise `SettingError` (owner: the instance's class) for the first field that fails its check."""
    for name, (ok, fix) in checks.items():
        value = getattr(instance, name)
        if not ok(value):
            raise SettingError(type(instance).__name__, name, value, fix)


def as_enum(instance: object, name: str, kind: type[Enum], fix: str) -> None:
    """Turn the string in field `name` into its `kind` member, or raise `SettingError`."""
    value = getattr(instance, name)
    try:
        object.__setattr__(instance, name, kind(value))
    except ValueError:
        raise SettingError(type(instance).__name__, name, value, fix) from None


def choices(kind: type[Enum]) -> str:
    return f"use one of {', '.join(member.value for member in kind)}"


@dataclass
class PlanOptions:
    """What to plan: the one set of plan settings HolmesStrategy (`options=`), train.py, the plan CLI and the bench
    take (in configs, the `strategy` node: `strategy.pp=2`, `strategy.memory_limit_gb=80`). What the machine costs is
    not here: that is `MachineCosts`, measured at job start or assumed.

    schedule: torch's pipeline schedule, or `auto`: the planner plans each (`MODELLED_SCHEDULES`) and takes the best
    (the fastest predicted step; of those within 2% of it, the least memory). partition: `auto` (minimise the
    predicted step), `uniform`, or layers per stage (per virtual stage also accepted for the interleaved and V
    schedules). pp / dp: None = choose. layout: `holmes`, `nic_unaware` (Megatron-LM rank order) or `flat_fsdp`.
    sharding inside each stage: `fsdp`, `none` (full replicas, gradients all-reduced) or `auto` (the faster of the
    two, FSDP on a tie since it needs less memory). backend: the collective library (gloo's reduce-scatter costs a
    whole all-reduce). chunks_per_stage: model chunks per stage for the interleaved schedules (the V schedules,
    ZBVZeroBubble and DualPipeV, run two). state_multiplier: bytes of weights, grads and optimizer state per parameter
    byte (4: fp32 AdamW). memory_limit_gb: per device, None = unchecked. activation_checkpointing: `off`, `full`,
    `selective` or `auto` (`Checkpointing`; auto turns it on per stage, only where the stage does not fit without it).
    """

    schedule: Schedule = Schedule["1F1B"]
    partition: Partition = PartitionRule.auto
    pp: int | None = None
    dp: int | None = None
    layout: LayoutKind = LayoutKind.holmes
    sharding: Sharding = Sharding.auto
    backend: Backend = Backend.nccl
    chunks_per_stage: int = 2
    state_multiplier: float = 4.0
    memory_limit_gb: float | None = None
    activation_checkpointing: Checkpointing = Checkpointing.auto

    def __post_init__(self) -> None:
        as_enum(self, "schedule", Schedule, choices(Schedule))
        as_enum(self, "activation_checkpointing", Checkpointing, choices(Checkpointing))
        as_enum(self, "layout", LayoutKind, choices(LayoutKind))
        as_enum(self, "sharding", Sharding, choices(Sharding))
        as_enum(self, "backend", Backend, choices(Backend))
        self.partition = _partition(self)
        check_fields(
            self,
            {
                "pp": (_positive_or_none, "use a positive number of stages, or None to let the planner pick"),
                "dp": (_positive_or_none, "use a positive DP size, or None to let the planner pick"),
                "chunks_per_stage": (_positive_int, "use >= 1 (2 interleaves two chunks)"),
                "state_multiplier": (lambda v: v >= 1, "use >= 1 bytes per parameter byte (4: fp32 AdamW)"),
                "memory_limit_gb": (lambda v: v is None or v > 0, "use the device memory in GB, or None"),
            },
        )

    @property
    def chunks(self) -> int:
        """Model chunks per stage the schedule runs."""
        if self.schedule.v_shaped:
            return 2
        return self.chunks_per_stage if self.schedule.interleaved else 1

    def settings(self) -> PlanOptions:
        """These settings as a plain `PlanOptions` (a subclass, e.g. the `strategy` config node, holds more)."""
        return PlanOptions(**{f.name: getattr(self, f.name) for f in fields(PlanOptions)})


def _partition(options: PlanOptions) -> Partition:
    fix = "use auto, uniform, or a list of layers per stage (each >= 1)"
    value = options.partition
    if isinstance(value, str):
        try:
            return PartitionRule(value)
        except ValueError:
            raise SettingError("PlanOptions", "partition", value, fix) from None
    counts = tuple(value)
    if not counts or not all(_positive_int(count) for count in counts):
        raise SettingError("PlanOptions", "partition", list(counts), fix)
    return counts


@dataclass(frozen=True)
class BatchSettings:
    """Samples (sequences) per optimizer step over all DP ranks; `microbatches=None` lets the planner choose."""

    global_batch: int
    microbatches: int | None = None

    @classmethod
    def requested(cls, global_batch: int | None, microbatches: int | None) -> BatchSettings | None:
        """The batch settings a caller gave, or None without a global batch (then without micro-batches too)."""
        if global_batch is None and microbatches is not None:
            fix = "also give global_batch=<samples per optimizer step>: micro-batches split it"
            raise SettingError(cls.__name__, "microbatches", microbatches, fix)
        return None if global_batch is None else cls(global_batch, microbatches)

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "global_batch": (_positive_int, "use a positive number of samples per optimizer step"),
                "microbatches": (_positive_or_none, "use a positive count, or None to let the planner pick"),
            },
        )
