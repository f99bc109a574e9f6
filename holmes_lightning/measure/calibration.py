"""What one rank of this machine costs the cost model, measured on the model being planned and cached per machine.

In one process, alone (HolmesStrategy's rank 0 at job start, or the benchmark before its runs), on one copy of each
distinct pipeline layer (a layer on the meta device gets a full copy on the device, one at a time):

- forward + backward at 2 samples and at the first of 8, 16, ... that takes `SLOPE_RATIO` x as long (a small
  layer's time per sample hides in the noise of its fixed cost otherwise): the slope is the time per sample (the
  profile's FLOPs over it: the device's FLOP/s on this model), what is left at zero samples the fixed cost of a pass;
- the same under FSDP2 on a group of one rank, the weights kept gathered with no gradient sync (a pipeline's
  micro-batches) and freed after forward with it (pp=1): FSDP's hooks per layer and pass;
- one fused AdamW step (the recipe's optimizer) over the plain and over the FSDP (DTensor) parameters;
- at the larger sample count, the forward alone and the forward with the input gradients alone: what is left of
  the whole pass is the weight-gradient pass, the share of the backward a zero-bubble schedule runs apart.

Each is the median of rounds (every kind of pass once per round) repeated for `LAYER_SECONDS` per distinct layer
($HOLMES_CALIBRATION_SECONDS overrides it): a shared machine's speed drifts by 10-20% over seconds, so a second of
rounds says more than a few of them.
These single-process results are cached per device, torch version and model shape (`cache_dir()`); a later job with
the same ones reads them instead. With every rank of the job (`measure.together`: `handoff`, `step_collectives_s`): the
latency and CPU of a message between two ranks while every rank computes, and a step's closing collectives. When
every rank of the job computes on one machine's CPU cores, the cost model gets a rank's speed alone, the core count
and a message's CPU, and times how fast each computes beside the others (`planner.sharing`); CPU ranks spread over
several machines are each credited their share of their machine's cores (`measure.rank_share`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from holmes_lightning.measure.layer_io import (
    Flow,
    apply,
    as_tuple,
    backward,
    detached,
    input_gradients,
    moved,
    nbytes,
    repeated,
    samples,
    shapes,
)
from holmes_lightning.planner import MachineCosts, ModelProfile

# forward + backward is timed at 2 samples (BatchNorm trains on no fewer) and at 8 or, for a small layer, a multiple
FIT_SAMPLES = (2, 8)
SLOPE_RATIO = 1.5  # the larger count's pass takes at least this x the smaller one's, so its slope is measurable
MAX_SLOPE_BYTES = 64 * 2**20  # the larger count's output stays below this (doubling stops at it)
LAYER_SECONDS = 1.5  # each distinct layer is timed this long: the machine's speed drifts over seconds
MIN_ROUNDS = 3  # and at least this many rounds after a warm-up one
CACHE_ENV = "HOLMES_CALIBRATION_DIR"
SECONDS_ENV = "HOLMES_CALIBRATION_SECONDS"  # overrides LAYER_SECONDS
CACHE_VERSION = 5  # 4: per precision, 5: the weight-gradient pass timed
# Lightning's precision -> (the dtype the layers hold, the dtype autocast computes in); what the runtime trains with
PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "32-true": (None, None),
    "64-true": (torch.float64, None),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
    "bf16-mixed": (None, torch.bfloat16),
    "16-mixed": (None, torch.float16),
}


@dataclass(frozen=True)
class Measurement:
    """The model's costs in one process alone on `device` (whole model: sums over its layers; seconds)."""

    device: str
    per_sample_s: float
    pass_overhead_s: float
    optimizer_s: float
    fsdp_pass_s: float
    fsdp_reshard_pass_s: float
    fsdp_optimizer_s: float
    weight_share: float | None = None  # of the backward's seconds, the weight-gradient pass's (None: not timed)


@dataclass(frozen=True)
class Calibration:
    """What was measured of one rank of this machine on the model, and the `MachineCosts` made of it.

    Measured in one process alone: `gflops` per marginal sample, `pass_overhead_s` (forward + backward at zero
    samples, whole model) and `optimizer_s` (one AdamW step over the model), on `device`. The cost model gets them in
    `costs`, at the rank's `share` of the device (`device_tflops`): per layer and micro-batch, per GB, FSDP2's hooks
    per layer, and what every rank measured together (a message's latency and CPU, a step's closing collectives).
    `transfer_cpu_s_per_byte`: what moving a byte between two ranks sharing `costs.shared_cores` costs those cores
    (0: not measured).
    """

    gflops: float
    pass_overhead_s: float
    optimizer_s: float
    share: float
    device_tflops: float
    costs: MachineCosts
    device: str = ""
    transfer_cpu_s_per_byte: float = 0.0

    @classmethod
    def of(
        cls,
        measured: Measurement,
        profile: ModelProfile,
        *,
        share: float,
        peak_tflops: float | None = None,
        assumed: MachineCosts | None = None,
        transfer_cpu_s_per_byte: float = 0.0,
        **together: float | None,
    ) -> Calibration:
        """A rank's costs from one process's `measured` ones, when it gets `share` of the device. Compute counts as a
        fraction of a `peak_tflops` device (None: this rank's speed is the topology's device speed, as in the lab's
        topology). `together`: the `MachineCosts` fields measured with every rank (`latency_s`, `message_cpu_s`,
        `closing_s`, `shared_cores`); the costs nothing measured stay as `assumed` (e.g. `dp_overlap`)."""
        assumed = assumed or MachineCosts()
        gflops = profile.flops_per_sample / max(measured.per_sample_s, 1e-12) / 1e9
        device_tflops = gflops * share / 1e3
        per_layer = profile.num_layers * share
        costs = replace(
            assumed,
            efficiency=1.0 if peak_tflops is None else device_tflops / peak_tflops,
            layer_overhead_s=measured.pass_overhead_s / per_layer,
            optimizer_s_per_gb=measured.optimizer_s / ((profile.trained_bytes or profile.param_bytes) / 1e9) / share,
            fsdp_layer_s=measured.fsdp_pass_s / per_layer,
            fsdp_reshard_layer_s=measured.fsdp_reshard_pass_s / per_layer,
            fsdp_optimizer_layer_s=measured.fsdp_optimizer_s / per_layer,
            weight_share=measured.weight_share,
            **together,
        )
        return cls(
            gflops=gflops,
            pass_overhead_s=measured.pass_overhead_s,
            optimizer_s=measured.optimizer_s,
            share=share,
            device_tflops=device_tflops,
            costs=costs,
            device=measured.device,
            transfer_cpu_s_per_byte=transfer_cpu_s_per_byte,
        )

    def as_devices(self, world_size: int) -> Calibration:
        """These costs (measured for ranks sharing `costs.shared_cores` cores) as `world_size` ranks of a device each,
        every one at its share of the cores while all compute: a GPU cluster as the lab emulates it."""
        cores = self.costs.shared_cores
        if cores is None:
            return self
        share = min(1.0, cores / world_size) * self.share
        slower = self.share / share
        costs = replace(self.costs.slowed(slower), shared_cores=None)
        return replace(self, share=share, device_tflops=self.device_tflops / slower, costs=costs)

    def record(self) -> dict:
        """Every measured and derived number in one flat dict (the benches' JSON)."""
        flat = asdict(self)
        return {**flat.pop("costs"), **flat}

    def _sharing(self) -> str:
        cores = self.costs.shared_cores
        if cores is None:
            return f"x {self.share:g} device share"
        moving = self.transfer_cpu_s_per_byte * 1e9
        return f"every rank on {cores:g} shared cores, slower while more compute at once" + (
            f", {moving:.2g} CPU-s per GB moved between ranks" if moving else ""
        )

    def _step_extras(self) -> str:
        """What the job's ranks measured together at start besides the latency."""
        closing, message = self.costs.closing_s, self.costs.message_cpu_s
        described = "" if closing is None else f", a step's closing collectives {closing * 1e3:.2f} ms"
        return described + (f", {message * 1e3:.2f} CPU-ms per message" if message else "")

    def _weight_pass(self) -> str:
        share = self.costs.weight_share
        return "" if share is None else f" weight-gradient pass {share:.0%} of a backward;"

    def describe(self) -> str:
        costs = self.costs
        return (
            f"{self.device or 'this device'}, one rank measured alone: {self.gflops:.3g} GFLOP/s per sample + "
            f"{self.pass_overhead_s * 1e3:.1f} ms per forward+backward pass, AdamW step {self.optimizer_s * 1e3:.1f} "
            f"ms; {self._sharing()} -> device_tflops={self.device_tflops:.3g}, "
            f"layer_overhead_s={costs.layer_overhead_s:.3g}, optimizer_s_per_gb={costs.optimizer_s_per_gb:.3g}, FSDP "
            f"per layer {costs.fsdp_layer_s * 1e3:.2f} ms (kept) / {costs.fsdp_reshard_layer_s * 1e3:.2f} ms "
            f"(resharded) + optimizer {costs.fsdp_optimizer_layer_s * 1e3:.2f} ms;{self._weight_pass()} message "
            f"latency {costs.latency_s * 1e3:.2f} ms{self._step_extras()}"
        )


def measure(
    layers: Sequence[nn.Module],
    sample: Flow,
    *,
    device: torch.device,
    seconds: float | None = None,
    group: dist.ProcessGroup | None = None,
    fresh: bool = False,
    precision: str = "32-true",
) -> Measurement:
    """Time `layers` (applied in order to `sample`, samples first) on `device`, each distinct one for `seconds` (None:
    `layer_seconds()`), or read the cached result (`fresh`: time them anyway and cache the new result). Under
    Lightning's `precision` as training runs it: bf16-mixed computes under autocast and shards with FSDP2's bf16
    mixed-precision policy, bf16-true holds the layers in bf16.

    FSDP2 runs on `group`, a group of this rank alone; None: a world of one process made for the moment (there must
    be no default group then).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} cannot be calibrated; use one of {list(PRECISIONS)}")
    path = cache_dir() / f"{_cache_key(layers, sample, device, precision)}.json"
    if path.is_file() and not fresh:
        return Measurement(**json.loads(path.read_text()))
    seconds = layer_seconds() if seconds is None else seconds
    measured = _measure(layers, sample, device=device, seconds=seconds, group=group, precision=precision)
    write_whole(path, asdict(measured))
    return measured


def layer_seconds() -> float:
    """How long each distinct layer is timed: $HOLMES_CALIBRATION_SECONDS, else `LAYER_SECONDS`."""
    value = os.environ.get(SECONDS_ENV, str(LAYER_SECONDS))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{SECONDS_ENV}={value!r}: give the seconds to time each distinct layer, e.g. {LAYER_SECONDS}")
    return seconds


def write_whole(path: Path, data: dict) -> None:
    """Write `data` as JSON to `path` whole or not at all (concurrent jobs may read it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(data))
    partial.replace(path)


def cache_dir() -> Path:
    """Where measurements are kept: $HOLMES_CALIBRATION_DIR, else ~/.cache/holmes_lightning/calibration."""
    default = Path.home() / ".cache" / "holmes_lightning" / "calibration"
    return Path(os.environ.get(CACHE_ENV, default))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"cpu:{models[0] if models else platform.processor()} x{os.cpu_count()}"


def _cache_key(layers: Sequence[nn.Module], sample: Flow, device: torch.device, precision: str) -> str:
    shape = {
        "version": CACHE_VERSION,
        "device": device_name(device),
        "precision": precision,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "samples": [FIT_SAMPLES, SLOPE_RATIO, MAX_SLOPE_BYTES],
        "sample": shapes(sample),
        "layers": [_signature(layer) for layer in layers],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:24]


def _signature(layer: nn.Module) -> list:
    """What a layer's cost depends on besides its input: its type and every tensor's name, shape and dtype."""
    tensors = [*layer.named_parameters(), *layer.named_buffers()]
    return [type(layer).__name__, [[name, list(t.shape), str(t.dtype)] for name, t in tensors]]


@dataclass
class _LayerTimes:
    per_sample_s: float
    fixed_s: float
    optimizer_s: float
    fsdp_s: float
    fsdp_reshard_s: float
    fsdp_optimizer_s: float
    backward_s: float  # at the larger sample count, whole and its weight-gradient pass
    weight_s: float


def _measure(
    layers: Sequence[nn.Module],
    sample: torch.Tensor,
    *,
    device: torch.device,
    seconds: float,
    group: dist.ProcessGroup | None,
    precision: str,
) -> Measurement:
    """Each distinct layer timed once on the input it gets in the model; repeats of it count its times again."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a lab rank is one thread
    times: dict[str, tuple[_LayerTimes, Flow]] = {}
    total: list[_LayerTimes] = []
    held, _ = PRECISIONS[precision]
    x = moved(samples(sample, 1), device)  # one sample: FIT_SAMPLES sets the batch sizes timed
    x = x if held is None else _in_dtype(x, held)
    try:
        random_state = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with random_state, _single_rank_mesh(device, group) as mesh:
            for layer in layers:
                key = json.dumps([_signature(layer), shapes(x)])
                if key not in times:
                    times[key] = _time_layer(layer, x, mesh=mesh, device=device, seconds=seconds, precision=precision)
                layer_times, x = times[key]
                total.append(layer_times)
    finally:
        torch.set_num_threads(threads)
    return Measurement(
        device=device_name(device),
        per_sample_s=sum(t.per_sample_s for t in total),
        pass_overhead_s=sum(t.fixed_s for t in total),
        optimizer_s=sum(t.optimizer_s for t in total),
        fsdp_pass_s=sum(t.fsdp_s for t in total),
        fsdp_reshard_pass_s=sum(t.fsdp_reshard_s for t in total),
        fsdp_optimizer_s=sum(t.fsdp_optimizer_s for t in total),
        weight_share=_weight_share(total),
    )


def _weight_share(total: Sequence[_LayerTimes]) -> float | None:
    """Of the model's backward seconds, the weight-gradient passes' (None: no backward measured)."""
    backward = sum(t.backward_s for t in total)
    return min(1.0, sum(t.weight_s for t in total) / backward) if backward > 0 else None


def _time_layer(
    layer: nn.Module, x: Flow, *, mesh: DeviceMesh, device: torch.device, seconds: float, precision: str
) -> tuple[_LayerTimes, Flow]:
    """One layer's times (medians of rounds over `seconds`, every kind of pass in each), and its output on one sample
    (the next layer's input; computed on `FIT_SAMPLES[0]` copies of it)."""
    held, computed = PRECISIONS[precision]
    plain, kept, resharded = (_copy_on(layer, device, held) for _ in range(3))
    policy = MixedPrecisionPolicy(computed, torch.float32) if computed is torch.bfloat16 else MixedPrecisionPolicy()
    for wrapped, reshard in ((kept, False), (resharded, True)):
        fully_shard(wrapped, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    kept.set_requires_gradient_sync(False)  # a pipeline's micro-batches: gradients accumulate, weights stay gathered
    kept.set_reshard_after_backward(False)
    autocast = torch.autocast(device.type, dtype=computed, enabled=computed is not None)
    with autocast:
        few, many = FIT_SAMPLES[0], _slope_samples(plain, x, device)
    inputs = {n: repeated(x, n) for n in (few, many)}
    names = ("few", "many", "kept", "resharded", "adam", "adam_fsdp", "forward", "input")
    runs: dict[str, list[float]] = {name: [] for name in names}
    optimizers = {id(net): _adamw(net) for net in (plain, resharded)}
    start, rounds = time.perf_counter(), 0
    while rounds <= MIN_ROUNDS or time.perf_counter() - start < seconds:
        rounds += 1  # the first round warms up allocator and kernels
        with autocast:
            runs["few"].append(_pass_s(plain, inputs[few], device))
            runs["many"].append(_pass_s(plain, inputs[many], device))
            runs["kept"].append(_pass_s(kept, inputs[few], device))
            runs["resharded"].append(_pass_s(resharded, inputs[few], device))
            runs["forward"].append(_pass_s(plain, inputs[many], device, until="forward"))
            runs["input"].append(_pass_s(plain, inputs[many], device, until="input"))
        runs["adam"].append(_step_s(optimizers[id(plain)], device))
        runs["adam_fsdp"].append(_step_s(optimizers[id(resharded)], device))
    median = {name: statistics.median(values[1:]) for name, values in runs.items()}
    per_sample = max(median["many"] - median["few"], 0.0) / (many - few)
    with torch.no_grad(), autocast:
        out = samples(apply(plain, inputs[few]), 1)
    return (
        _LayerTimes(
            per_sample_s=per_sample,
            fixed_s=max(median["few"] - few * per_sample, 0.0),
            optimizer_s=median["adam"],
            fsdp_s=max(median["kept"] - median["few"], 0.0),
            fsdp_reshard_s=max(median["resharded"] - median["few"], 0.0),
            fsdp_optimizer_s=max(median["adam_fsdp"] - median["adam"], 0.0),
            backward_s=max(median["many"] - median["forward"], 0.0),
            weight_s=max(median["many"] - median["input"], 0.0),
        ),
        detached(out),
    )


def _slope_samples(net: nn.Module, x: Flow, device: torch.device) -> int:
    """The sample count to time beside `FIT_SAMPLES[0]`: `FIT_SAMPLES[1]`, doubled while its pass takes less than
    `SLOPE_RATIO` x the smaller count's and its output stays under `MAX_SLOPE_BYTES`."""

    def fastest_s(samples: int) -> float:
        return min(_pass_s(net, repeated(x, samples), device) for _ in range(3))

    few = FIT_SAMPLES[0]
    with torch.no_grad():
        sample_bytes = nbytes(apply(net, repeated(x, few))) / few
    few_s, many = fastest_s(few), FIT_SAMPLES[1]
    while 2 * many * sample_bytes <= MAX_SLOPE_BYTES and fastest_s(many) < SLOPE_RATIO * few_s:
        many *= 2
    return many


def _copy_on(layer: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """A copy of `layer` on `device` with storage (a meta layer's filled with small random values), its floating
    tensors in `dtype` (None: as they are)."""
    twin = copy.deepcopy(layer)
    if not any(t.is_meta for t in (*twin.parameters(), *twin.buffers())):
        return twin.to(device) if dtype is None else twin.to(device, dtype)
    twin = twin.to_empty(device=device) if dtype is None else twin.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for tensor in (*twin.parameters(), *twin.buffers()):
            tensor.normal_(0.0, 0.02) if tensor.is_floating_point() else tensor.zero_()
    return twin


def _pass_s(net: nn.Module, inputs: Flow, device: torch.device, until: str = "weight") -> float:
    """Seconds of one forward + backward (gradient of ones at the output), gradients left in the parameters;
    `until`: "forward" stops after the forward, "input" after the input gradients (no weight gradients)."""
    inputs = detached(inputs, requires_grad=True)
    synchronize(device)
    start = time.perf_counter()
    out = apply(net, inputs)
    if until == "input":
        input_gradients(out, inputs)
    elif until == "weight":
        backward(out)
    synchronize(device)
    return time.perf_counter() - start


def _in_dtype(flow: Flow, dtype: torch.dtype) -> Flow:
    """`flow`'s floating tensors in `dtype` (a model held in it takes them so)."""
    tensors = tuple(t.to(dtype) if t.is_floating_point() else t for t in as_tuple(flow))
    return tensors if isinstance(flow, tuple) else tensors[0]


def _adamw(net: nn.Module) -> torch.optim.Optimizer | None:
    """The recipe's optimizer over `net`; None for a layer without parameters (an activation, a reshape)."""
    params = [p for p in net.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-6, fused=True) if params else None


def _step_s(optimizer: torch.optim.Optimizer | None, device: torch.device) -> float:
    if optimizer is None:
        return 0.0
    synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    synchronize(device)
    optimizer.zero_grad(set_to_none=False)  # keep the gradients: every round steps over all of them
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _single_rank_mesh(device: torch.device, group: dist.ProcessGroup | None) -> Iterator[DeviceMesh]:
    """A DeviceMesh of this rank alone: over `group`, else over a world of one process made for the moment."""
    if group is not None:
        yield DeviceMesh.from_group(group, device.type)
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh.from_group(dist.group.WORLD, device.type)
    finally:
        dist.destroy_process_group()
