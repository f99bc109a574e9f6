"""Calibration: what the cost model is told about this machine, measured on the model itself and cached."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch
from torch import nn

from holmes_lightning.measure import calibration, together
from holmes_lightning.measure.calibration import Calibration, Measurement
from holmes_lightning.measure.together import cross_node_partners
from holmes_lightning.planner import LayerProfile, MachineCosts, ModelProfile
from holmes_lightning.planner.cost import CostModel
from holmes_lightning.runtime import HolmesStrategy
from holmes_lightning.topology import Topology

MEASURED = Measurement(
    device="cpu:test",
    per_sample_s=0.004,
    pass_overhead_s=0.006,
    optimizer_s=0.002,
    fsdp_pass_s=0.003,
    fsdp_reshard_pass_s=0.009,
    fsdp_optimizer_s=0.0015,
)


def three_layers(flops: float = 1e9, param_bytes: float = 1e6) -> ModelProfile:
    layer = LayerProfile("layer", flops / 3, 2 * flops / 3, param_bytes, 1e3, 1e3)
    return ModelProfile("three", (layer, layer, layer), tokens_per_sample=8)


def test_a_ranks_costs_are_the_measurement_at_its_share_spread_over_layers():
    profile = three_layers()
    calibrated = Calibration.of(MEASURED, profile, share=0.5, latency_s=1e-3)
    assert calibrated.gflops == pytest.approx(3e9 / 0.004 / 1e9)  # the model's FLOPs over the time per sample
    assert calibrated.device_tflops == pytest.approx(calibrated.gflops * 0.5 / 1e3)
    per_layer = 3 * 0.5  # three layers, each at half a core
    costs = calibrated.costs
    assert costs.layer_overhead_s == pytest.approx(0.006 / per_layer)
    assert costs.fsdp_layer_s == pytest.approx(0.003 / per_layer)
    assert costs.fsdp_reshard_layer_s == pytest.approx(0.009 / per_layer)
    assert costs.fsdp_optimizer_layer_s == pytest.approx(0.0015 / per_layer)
    assert costs.optimizer_s_per_gb == pytest.approx(0.002 / (3e6 / 1e9) / 0.5)
    assert (costs.efficiency, costs.latency_s) == (1.0, 1e-3)  # no peak given: the topology runs at this speed
    on_a_device = Calibration.of(MEASURED, profile, share=0.5, peak_tflops=calibrated.device_tflops * 4)
    assert on_a_device.costs.efficiency == pytest.approx(0.25)
    assumed = MachineCosts(dp_overlap=0.0, latency_s=5.0)
    kept = Calibration.of(MEASURED, profile, share=0.5, assumed=assumed, latency_s=1e-3).costs
    assert (kept.dp_overlap, kept.latency_s) == (0.0, 1e-3)  # not measured: as assumed; measured: as measured
    assert "cpu:test" in calibrated.describe() and "latency 1.00 ms" in calibrated.describe()
    record = calibrated.record()
    assert record["gflops"] == calibrated.gflops and record["layer_overhead_s"] == costs.layer_overhead_s


class Scale(nn.Module):
    """A layer of someone else's model: a learned per-feature scale."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def stranger_layers() -> list[nn.Module]:
    """An MLP as pipeline layers: one input layer, three identical hidden ones, an output layer."""
    return [nn.Linear(6, 16), *(nn.Sequential(nn.Linear(16, 16), Scale(16)) for _ in range(3)), nn.Linear(16, 2)]


def test_ranks_on_shared_cores_are_planned_alone_or_as_devices_at_their_share():
    profile = three_layers()
    shared = Calibration.of(MEASURED, profile, share=1.0, latency_s=1e-3, shared_cores=2)
    assert shared.costs.shared_cores == 2
    devices = shared.as_devices(4)  # four ranks, each half of one of the two cores while all compute
    assert devices == Calibration.of(MEASURED, profile, share=0.5, latency_s=1e-3)
    alone = replace(shared, costs=replace(shared.costs, shared_cores=None))  # a core each: as fast as measured
    assert devices.costs.shared_cores is None and shared.as_devices(1) == alone


def test_each_distinct_layer_is_timed_once_and_the_result_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    layers = stranger_layers()
    ran: list[int] = []
    for index, layer in enumerate(layers):  # copies of a layer keep its hooks: they log the original's index
        layer.register_forward_hook(lambda _module, _args, _out, index=index: ran.append(index))
    measured = calibration.measure(layers, torch.randn(1, 6), device=torch.device("cpu"), seconds=0)
    assert sorted(set(ran)) == [0, 1, 4]  # the second and third hidden layers repeat the first one's times
    assert measured.per_sample_s >= 0 and measured.pass_overhead_s > 0 and measured.optimizer_s > 0
    assert min(measured.fsdp_pass_s, measured.fsdp_reshard_pass_s, measured.fsdp_optimizer_s) >= 0
    assert [p.name for p in tmp_path.glob("*.json")] != []
    ran.clear()
    again = calibration.measure(stranger_layers(), torch.randn(4, 6), device=torch.device("cpu"))
    assert again == measured and ran == []  # same machine and shape per sample: read, not timed
    wider = calibration.measure(  # a DataLoader's batch of 4 samples: timed on one of them
        [nn.Linear(6, 32), nn.Linear(32, 2)], torch.randn(4, 6), device=torch.device("cpu"), seconds=0
    )
    assert wider != measured and len(list(tmp_path.glob("*.json"))) == 2


def test_a_fresh_measurement_times_the_layers_again_and_replaces_the_cached_one(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    layers = stranger_layers()
    measured = calibration.measure(layers, torch.randn(1, 6), device=torch.device("cpu"), seconds=0)
    (cached,) = tmp_path.glob("*.json")
    cached.write_text(json.dumps({**asdict(measured), "per_sample_s": 123.0}))  # a stale result from another time
    assert calibration.measure(layers, torch.randn(1, 6), device=torch.device("cpu")).per_sample_s == 123.0
    again = calibration.measure(layers, torch.randn(1, 6), device=torch.device("cpu"), seconds=0, fresh=True)
    assert again.per_sample_s != 123.0 and json.loads(cached.read_text())["per_sample_s"] == again.per_sample_s


def test_layers_on_the_meta_device_are_timed_on_real_copies(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    with torch.device("meta"):
        layers = stranger_layers()
    measured = calibration.measure(layers, torch.randn(1, 6), device=torch.device("cpu"), seconds=0)
    assert measured.per_sample_s >= 0 and measured.pass_overhead_s > 0
    assert all(p.is_meta for layer in layers for p in layer.parameters())  # the model itself stays unallocated


def test_layers_without_parameters_are_timed_and_small_layers_on_more_samples(tmp_path, monkeypatch):
    """The README's MLP has ReLU layers (nothing for an optimizer); its Linear layers are so small that their time per
    sample hides in the fixed cost of a pass at 4 samples, so they are timed on more."""
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    layers = [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)]
    measured = calibration.measure(layers, torch.randn(1, 32), device=torch.device("cpu"), seconds=0)
    assert measured.optimizer_s > 0 and measured.per_sample_s >= 0
    tiny = nn.Linear(3, 4)
    assert calibration._slope_samples(tiny, torch.randn(1, 3), torch.device("cpu")) > calibration.FIT_SAMPLES[1]


def test_the_weight_gradient_pass_is_timed_apart_and_scales_the_layers_flop_shares(tmp_path, monkeypatch):
    """A stack of matrix multiplies spends about half of each backward on weight gradients (its two gradients cost
    alike); the measured share goes into the costs, and each layer's FLOP share is scaled so the model's matches."""
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    layers = [nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)]
    measured = calibration.measure(layers, torch.randn(1, 256), device=torch.device("cpu"), seconds=0.3)
    assert 0.2 < measured.weight_share < 0.8
    profile = ModelProfile(
        "two_kinds",
        (
            LayerProfile("matmul", 1e9, 2e9, 1e6, 1e3, 1e3, weight_flops=1e9),  # FLOP share 0.5
            LayerProfile("activation", 1e8, 1e8, 0.0, 1e3, 1e3, weight_flops=0.0),
        ),
        tokens_per_sample=8,
    )
    costs = Calibration.of(replace(MEASURED, weight_share=0.3), profile, share=1.0).costs
    assert (
        costs.weight_share == 0.3
        and "weight-gradient pass 30% of a backward"
        in Calibration.of(replace(MEASURED, weight_share=0.3), profile, share=1.0).describe()
    )
    shares = CostModel(topology=None, profile=profile, machine=costs).weight_shares()
    backward = [layer.backward_flops for layer in profile.layers]
    assert sum(s * b for s, b in zip(shares, backward, strict=True)) / sum(backward) == pytest.approx(0.3)
    assert shares[1] == 0.0  # a layer without weights still has no weight pass
    unmeasured = CostModel(topology=None, profile=profile, machine=MachineCosts()).weight_shares()
    assert unmeasured == [0.5, 0.0]


@pytest.mark.slow
def test_the_latency_of_local_ranks_is_measured_in_processes_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    latency = together.local_handoff_latency_s(2)
    assert 0 < latency < 1
    assert len(list(tmp_path.glob("handoff-*.json"))) == 1
    assert together.local_handoff_latency_s(2) == latency
    assert together.local_handoff_latency_s(1) == 0.0


def test_how_long_each_layer_is_timed_comes_from_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(calibration.SECONDS_ENV)
    assert calibration.layer_seconds() == calibration.LAYER_SECONDS
    monkeypatch.setenv(calibration.SECONDS_ENV, "0.25")
    assert calibration.layer_seconds() == 0.25
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(calibration.SECONDS_ENV, bad)
        with pytest.raises(ValueError, match=f"HOLMES_CALIBRATION_SECONDS={bad!r}: give the seconds"):
            calibration.layer_seconds()


def test_a_strategy_that_calibrates_refuses_a_bad_calibration_time_when_it_is_built(monkeypatch):
    monkeypatch.setenv(calibration.SECONDS_ENV, "soon")
    with pytest.raises(ValueError, match="HOLMES_CALIBRATION_SECONDS='soon'"):
        HolmesStrategy(cluster="single_node")
    assert HolmesStrategy(cluster="single_node", calibrate=False).calibrate is False  # it never times anything


def test_a_hand_off_is_timed_between_nodes_as_a_pipelines_messages_cross_them():
    """Nodes pair up in order and ranks by position; a node left over has no partner; one node: neighbours."""
    three_nodes = Topology.from_config("three_cluster")  # 8 nodes of 1 rank
    assert cross_node_partners(three_nodes) == [1, 0, 3, 2, 5, 4, 7, 6]
    wide = Topology.from_config({"name": "w", "devices_per_node": 2, "clusters": [{"name": "a", "nodes": 3}]})
    assert cross_node_partners(wide) == [2, 3, 0, 1, -1, -1]
    assert cross_node_partners(Topology.from_config("single_node")) == [1, 0]


def test_a_device_faster_than_its_config_is_planned_as_measured():
    faster = Calibration.of(MEASURED, three_layers(), share=1.0, peak_tflops=0.1)
    assert faster.costs.efficiency == pytest.approx(faster.device_tflops / 0.1) and faster.costs.efficiency > 1


def test_layers_are_timed_in_the_precision_training_runs_and_cached_per_precision(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    seen: list[torch.dtype] = []
    layers = stranger_layers()
    layers[0].register_forward_hook(lambda _module, _args, out: seen.append(out.dtype))
    sample = torch.randn(1, 6)
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        measured = calibration.measure(layers, sample, device=torch.device("cpu"), seconds=0, precision=precision)
        assert measured.per_sample_s >= 0 and measured.pass_overhead_s > 0
    assert {torch.float32, torch.bfloat16} <= set(seen)  # autocast, then layers held in bf16
    assert len(list(tmp_path.glob("*.json"))) == 3  # one cached measurement per precision
    with pytest.raises(ValueError, match=r"precision='8-bit' cannot be calibrated; use one of"):
        calibration.measure(layers, sample, device=torch.device("cpu"), precision="8-bit")
