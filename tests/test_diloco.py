"""DiLoCo's outer loop (`runtime.diloco`) between sites played by threads of this process, each with its own gloo
group over one in-memory store; how train.py chooses between one pipeline and DiLoCo (`cli.sites`); and, slow,
`python train.py cluster=two_sites_1gbps strategy.cross_site=diloco` training, saving and resuming exactly."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from holmes_lightning.cli.config import ConfigError, CrossSite, DiLoCoConfig, ModelConfig, TrainConfig
from holmes_lightning.cli.launch import main as launch_main
from holmes_lightning.cli.sites import (
    choose_sites,
    latest_of_every_site,
    one_plan_for_every_site,
    site_dir,
    site_resume,
)
from holmes_lightning.launch.processes import (
    OUTER_STORE_ENV,
    OUTER_SUPERVISED_ENV,
    SITE_ENV,
    SITES_ENV,
    launch_job,
    site_rank_envs,
)
from holmes_lightning.planner import BatchSettings, MachineCosts, ModelProfile, PlanOptions, best_plan
from holmes_lightning.planner.sites import DiLoCoSettings, predict_diloco, site_batches
from holmes_lightning.runtime.diloco import DiLoCo, Site, SiteError, SiteLaunch, _fragments, dequantize, quantize
from holmes_lightning.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = timedelta(seconds=30)


def as_sites(count: int, work: Callable[[int, dist.ProcessGroupGloo], Any]) -> list[Any]:
    """`work(site, group)` on `count` threads, one gloo group each over a shared in-memory store; their results."""
    store = dist.HashStore()
    results: list[Any] = [None] * count

    def run(site: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("outer", store), site, count, TIMEOUT)
        try:
            results[site] = work(site, group)
        except Exception as error:  # noqa: BLE001 - handed to the test, which raises it
            results[site] = error

    threads = [threading.Thread(target=run, args=(site,)) for site in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    failed = [result for result in results if isinstance(result, Exception) and not isinstance(result, SiteError)]
    if failed:
        raise failed[0]
    return results


def model(site: int, out_features: int = 3) -> nn.Module:
    torch.manual_seed(100 + site)  # every site builds other weights; DiLoCo starts them all from the first's
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, out_features))


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
def test_every_site_starts_from_the_first_sites_weights_and_takes_nesterov_steps_on_the_mean_change(bits):
    settings = DiLoCoSettings(sync_every=2, streaming=False, outer_lr=0.7, outer_momentum=0.9, outer_bits=bits)

    def work(site: int, group: dist.ProcessGroupGloo) -> dict[str, torch.Tensor]:
        net = model(site)
        diloco = DiLoCo(net.named_parameters(), group, settings, site_label=str(site))
        start = {name: p.detach().clone() for name, p in net.named_parameters()}
        with torch.no_grad():
            for step in (1, 2):  # each site's "inner steps" move its weights its own way
                for p in net.parameters():
                    p.sub_(0.1 * (site + 1) * step)
                diloco.after_inner_step(step)
        return {"start": start, "after": {n: p.detach().clone() for n, p in net.named_parameters()}}

    first, second = as_sites(2, work)
    for name, start in first["start"].items():
        assert torch.equal(second["start"][name], start)  # broadcast from site 0
        mean_change = torch.full_like(start, (0.1 + 0.2) * 3 / 2)  # each site moved 0.1 (site + 1) x (1 + 2)
        expected = start - 0.7 * (1 + 0.9) * mean_change  # SGD's first Nesterov step: g + momentum x (buffer = g)
        # each site's change is one value repeated: 8 and 4 bits carry it exactly, bf16 to its 8 bits of mantissa
        torch.testing.assert_close(
            first["after"][name], expected, **({"rtol": 1e-2, "atol": 1e-2} if bits == 16 else {})
        )
        assert torch.equal(second["after"][name], first["after"][name])


def test_frozen_weights_start_from_the_first_sites_and_are_neither_kept_nor_synced():
    settings = DiLoCoSettings(sync_every=1, streaming=False)

    def work(site: int, group: dist.ProcessGroupGloo) -> dict[str, Any]:
        net = model(site)
        net[0].requires_grad_(False)  # a frozen base under a trained head
        diloco = DiLoCo(net.named_parameters(), group, settings, site_label=str(site))
        start = net[0].weight.detach().clone()
        with torch.no_grad():
            net[1].weight.sub_(0.1 * (site + 1))
        diloco.after_inner_step(1)
        return {"start": start, "kept": sorted(diloco.state_dict()["outer"]), "frozen": net[0].weight.detach().clone()}

    first, second = as_sites(2, work)
    assert torch.equal(second["start"], first["start"])  # broadcast from site 0, frozen or not
    assert first["kept"] == second["kept"] == ["1.bias", "1.weight"]  # outer copies of what trains only
    assert torch.equal(first["frozen"], first["start"]) and torch.equal(second["frozen"], first["start"])


def test_a_streamed_fragment_lands_after_its_overlap_steps_keeping_the_progress_made_meanwhile():
    settings = DiLoCoSettings(sync_every=4, fragments=2, overlap_steps=1)

    def work(site: int, group: dist.ProcessGroupGloo) -> list[tuple[int, list[int]]]:
        net = model(site)
        diloco = DiLoCo(net.named_parameters(), group, settings, site_label=str(site))
        seen = []
        with torch.no_grad():
            for step in range(1, 9):
                for p in net.parameters():
                    p.add_(0.01 * (site + 1))
                diloco.after_inner_step(step)
                seen.append((step, sorted(sync.fragment for sync in diloco.pending)))
                if step == 3:
                    landed = [p.detach().clone() for p in net.parameters()]
            diloco.flush()
        return seen, sum(diloco.applied), [p.detach().clone() for p in net.parameters()], landed

    (seen, outer_steps, first, landed_a), (_, _, second, landed_b) = as_sites(2, work)
    # fragment 0 starts at steps 2 and 6, fragment 1 at 4 and 8; each is applied one inner step later
    assert seen == [(1, []), (2, [0]), (3, []), (4, [1]), (5, []), (6, [0]), (7, []), (8, [1])]
    assert outer_steps == 4
    fragments = _fragments([p.numel() for p in model(0).parameters()], 2)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        applied_last = i in fragments[1]  # flushed after step 8: equal; fragment 0 moved on locally at step 7-8
        assert torch.equal(a, b) == applied_last
    for i in fragments[0]:  # landed after step 3: the outer result plus each site's own step 3 (0.01 and 0.02)
        torch.testing.assert_close(landed_b[i] - landed_a[i], torch.full_like(landed_a[i], 0.01))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_values_are_within_half_a_step_of_their_block_and_take_bits_per_value_plus_a_scale(bits):
    values = torch.randn(1000) * torch.logspace(-3, 1, 1000)  # blocks of very different magnitudes
    packed = quantize(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 1024 * bits // 8 + 8 * 4  # 8 blocks of 128, fp32 scales
    back = dequantize(packed, bits, values.numel())
    blocks = torch.nn.functional.pad(values, (0, 24)).view(8, 128)
    half_step = (blocks.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1) / 2).expand(8, 128).flatten()[:1000]
    assert torch.all((back - values).abs() <= half_step * (1 + 1e-5))
    on_grid = torch.tensor([3.0, -3.0, 1.0, 0.0, -2.0])  # multiples of the step (3 / levels)... at 8 bits: 3 / 127
    assert torch.equal(dequantize(quantize(on_grid, bits), bits, 5)[[0, 1, 3]], on_grid[[0, 1, 3]])


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_sites_all_take_the_same_outer_step_near_the_full_precision_one(bits):
    settings = DiLoCoSettings(sync_every=1, streaming=False, outer_bits=bits)

    def work(site: int, group: dist.ProcessGroupGloo, settings: DiLoCoSettings) -> list[torch.Tensor]:
        net = model(0)
        diloco = DiLoCo(net.named_parameters(), group, settings, site_label=str(site))
        start = [p.detach().clone() for p in net.parameters()]
        generator = torch.Generator().manual_seed(site)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.01)
            diloco.after_inner_step(1)
        return [p.detach() - first for p, first in zip(net.parameters(), start, strict=True)]

    quantised = as_sites(3, lambda site, group: work(site, group, settings))
    exact = as_sites(3, lambda site, group: work(site, group, DiLoCoSettings(sync_every=1, streaming=False)))
    for a, b, c, full in zip(*quantised, exact[0], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)  # every site sums the same dequantised values
        # each site's change within half a step of its block's (largest magnitude < 0.05) scale, averaged, x 0.7 x 1.9
        step = 0.05 / (2 ** (bits - 1) - 1)
        torch.testing.assert_close(a, full, rtol=0, atol=0.7 * 1.9 * step / 2)


def test_sites_whose_ranks_hold_other_shards_are_refused_on_every_site():
    def work(site: int, group: dist.ProcessGroupGloo) -> Exception | None:
        try:
            DiLoCo(model(site, out_features=3 + site).named_parameters(), group, DiLoCoSettings(), site_label="X")
        except SiteError as error:
            return error
        return None

    errors = as_sites(2, work)
    assert all(isinstance(error, SiteError) and "plan alike" in str(error) for error in errors)


def test_fragments_are_consecutive_runs_of_about_equal_size():
    assert _fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert _fragments([100, 1, 1], 2) == [[0], [1, 2]]
    assert _fragments([5], 1) == [[0]]


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"fragments": 3, "sync_every": 2}, "fragments"),
        ({"sync_every": 10, "fragments": 2, "overlap_steps": 5}, "overlap_steps"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_bits": 3}, "outer_bits"),
    ],
)
def test_bad_diloco_settings_name_the_config_field(settings, field):
    with pytest.raises(ConfigError, match=rf"^diloco\.{field}="):
        DiLoCoConfig(**settings)


def test_streamed_sync_exposes_what_each_fragments_overlap_does_not_hide():
    plain = DiLoCoSettings(streaming=False)
    assert plain.exposed_s(10.0, 1.0) == 10.0
    assert DiLoCoSettings(overlap_steps=3).exposed_s(10.0, 1.0) == pytest.approx(7.0)
    assert DiLoCoSettings(fragments=5, overlap_steps=2, sync_every=50).exposed_s(10.0, 1.0) == 0.0
    assert DiLoCoSettings(fragments=2, overlap_steps=1, sync_every=50).exposed_s(10.0, 1.0) == pytest.approx(8.0)


def site_env(site: str, sites: str | None = "A|B") -> dict[str, str]:
    env = {SITE_ENV: site, OUTER_STORE_ENV: "10.0.0.1:29600"}
    return env | ({SITES_ENV: sites} if sites else {})


def test_a_rank_finds_its_site_its_machines_and_batch_share():
    topology = Topology.from_config("multi_site")
    site = Site.launched("multi_site", SiteLaunch.from_env(site_env("C", "A+B|C")), 32)
    assert (site.index, site.label, site.grouping) == (1, "C", (("A", "B"), ("C",)))
    assert [c.name for c in site.topology.spec.clusters] == ["C"]
    assert site.batch == site_batches(topology, (("A", "B"), ("C",)), 32)[1]
    fewest = Site.launched(topology, SiteLaunch.from_env(site_env("B+A", None)), None)
    assert (fewest.index, fewest.batch) == (0, None)  # clusters in any order; no global batch: none to share


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "HOLMES_SITE"),
        (site_env("D"), "sites='A|B' is not a way"),
        (site_env("A", "A+B|C"), "HOLMES_SITE=A: not a site"),
    ],
)
def test_a_rank_outside_any_site_is_told_what_to_set(env, message):
    with pytest.raises(ValueError, match=message):
        Site.launched("multi_site", SiteLaunch.from_env(env), 8)


def test_the_launcher_numbers_each_sites_ranks_from_zero_and_points_all_at_one_store():
    topology = Topology.from_config("multi_site")
    envs = site_rank_envs(topology, (("A", "B"), ("C",)), lambda node: f"10.0.{node}.1", "10.0.9.9:1234")
    by_site: dict[str, list[dict[str, str]]] = {}
    for env in envs:
        by_site.setdefault(env[SITE_ENV], []).append(env)
    assert {site: len(ranks) for site, ranks in by_site.items()} == {"A+B": 4, "C": 2}
    for ranks in by_site.values():
        assert [int(env["RANK"]) for env in ranks] == list(range(len(ranks)))
        assert {env["WORLD_SIZE"] for env in ranks} == {str(len(ranks))}
        assert len({env["MASTER_ADDR"] + env["MASTER_PORT"] for env in ranks}) == 1
    assert {(env[OUTER_STORE_ENV], env[OUTER_SUPERVISED_ENV]) for env in envs} == {("10.0.9.9:1234", "1")}
    assert by_site["A+B"][0]["MASTER_PORT"] != by_site["C"][0]["MASTER_PORT"]


@pytest.mark.slow
def test_a_lost_site_leaves_the_others_training_their_outer_steps_averaged_over_the_sites_left(tmp_path, capfd):
    sys.path.insert(0, str(ROOT / "tests"))
    from lost_site_script import LOSE_AT, STEPS, moved

    topology = Topology.from_config(
        {
            "name": "two_sites",
            "devices_per_node": 2,
            "inter_cluster": {"gbps": 1},
            "clusters": [{"name": name, "nodes": 1, "nic": {"kind": "ethernet", "gbps": 100}} for name in "AB"],
        }
    )
    command = [sys.executable, str(ROOT / "tests" / "lost_site_script.py"), str(tmp_path)]
    ended = launch_job(command, topology, sites=[["A"], ["B"]], may_lose=1)
    assert ended.code == 0
    assert "site A stops, the other sites go on without it" in capfd.readouterr().err
    saved = [torch.load(tmp_path / f"B-{rank}.pt") for rank in (0, 1)]  # site A hosted no store: B went on
    assert not list(tmp_path.glob("A-*.pt")) and [run["sites"] for run in saved] == [1, 1]
    torch.manual_seed(0)
    outer = [param.detach().clone() for param in nn.Linear(3, 2).parameters()]
    optimizer = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(1, STEPS + 1):  # the mean change of both sites until A is lost, then B's own
        left = (0, 1) if step < LOSE_AT else (1,)
        for param in outer:
            param.grad = torch.full_like(param, sum(moved(site) for site in left) / len(left))
        optimizer.step()
        for run in saved:  # both replicas, each of which sent half the values
            for got, expected in zip(run["after"][step - 1], outer, strict=True):
                torch.testing.assert_close(got, expected)


def config_for(cluster: str, mode: CrossSite, **diloco: Any) -> TrainConfig:
    config = TrainConfig(model=ModelConfig(name="gpt_7_5b", n_layers=36, d_model=4096, n_heads=32, seq_len=2048))
    config.strategy.cross_site = mode
    config.diloco = DiLoCoConfig(**diloco)
    config.data.global_batch = 64
    return config


def choose(cluster: str, mode: CrossSite, **diloco: Any) -> tuple[Any, Any, Any]:
    config = config_for(cluster, mode, **diloco)
    topology = Topology.from_config(cluster)
    profile = ModelProfile.from_gpt(config.model)
    batch, costs = BatchSettings(64), MachineCosts()
    pipeline = best_plan(topology, profile, batch, costs=costs)
    chosen = choose_sites(config, topology, pipeline, profile, batch=batch, options=PlanOptions(), costs=costs)
    diloco_run = predict_diloco(
        topology,
        profile,
        batch,
        (("A",), ("B",)) if cluster == "two_sites_1gbps" else (("A", "B"), ("C",)),
        parameters=profile.param_bytes / 2,
        settings=config.diloco.settings(),
        costs=costs,
    )
    return chosen, diloco_run.tokens_per_s, 64 * profile.tokens_per_sample / pipeline.prediction.total_s


def test_auto_takes_diloco_only_where_predicted_faster_and_allowed(capsys):
    chosen, diloco, pipeline = choose("two_sites_1gbps", CrossSite.auto, allowed=True)
    assert diloco > pipeline and chosen == (("A",), ("B",))
    chosen, *_ = choose("two_sites_1gbps", CrossSite.auto)  # not allowed: DiLoCo changes the optimisation
    assert chosen is None and "diloco.allowed=false" in capsys.readouterr().out
    chosen, diloco, pipeline = choose("multi_site", CrossSite.auto, allowed=True, sync_every=10, streaming=False)
    assert diloco < pipeline and chosen is None
    assert choose("two_sites_1gbps", CrossSite.pipeline)[0] is None


def test_diloco_on_one_site_is_refused_naming_the_setting():
    config = config_for("ib_only", CrossSite.diloco)
    with pytest.raises(ConfigError, match=r"strategy\.cross_site=diloco .*one site"):
        choose_sites(config, Topology.from_config("ib_only"), None, None, batch=None, options=PlanOptions(), costs=None)


def test_each_site_resumes_its_own_checkpoint_of_the_newest_step_all_saved(tmp_path):
    for site, steps in {"A": (4, 8, 12), "B": (4, 8)}.items():
        for step in steps:
            folder = Path(site_dir(str(tmp_path), site)) / f"step_{step:06d}.ckpt"
            folder.mkdir(parents=True)
            (folder / "complete.json").write_text("{}")
    newest = latest_of_every_site(str(tmp_path), (("A",), ("B",)))
    assert newest == tmp_path / "site-A" / "step_000008.ckpt"
    assert site_resume(str(newest), "B") == str(tmp_path / "site-B" / "step_000008.ckpt")
    assert latest_of_every_site(str(tmp_path / "none"), (("A",), ("B",))) is None


def train_py(output: Path, *overrides: str) -> None:
    argv = [sys.executable, str(ROOT / "train.py"), "cluster=two_sites_1gbps", "strategy.cross_site=diloco"]
    argv += ["strategy.calibrate=false", "trainer.log_every_n_steps=1", f"output_dir={output}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def losses(output: Path, site: str) -> dict[int, float]:
    (metrics,) = output.glob(f"*/csv/site-{site}/metrics.csv")
    rows = csv.DictReader(metrics.open())
    return {int(row["step"]): float(row["train_loss"]) for row in rows if row.get("train_loss")}


def weights(checkpoint: Path, out: Path) -> dict[str, Any]:
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_train_py_runs_diloco_over_two_sites_and_resumes_exactly(tmp_path):
    """Two sites of 2 ranks each, an outer step every 4 inner steps (streamed), checkpoints every 4: the sites read
    their own data order, hold the same weights at each outer step and resume from step 4 as they ran on."""
    common = ["diloco.sync_every=4", "checkpoint.every_n_steps=4", "trainer.max_steps=8", "trainer.warmup_steps=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train_py(full, *common)
    train_py(resumed, *common, f"resume={full}/checkpoints/site-A/step_000004.ckpt")
    for site in "AB":
        ran, again = losses(full, site), losses(resumed, site)
        assert set(again) == {4, 5, 6, 7} and all(again[s] == pytest.approx(ran[s], rel=1e-6) for s in again)
    assert losses(full, "A") != losses(full, "B")  # each site its own data order
    a, b = (weights(full / f"checkpoints/site-{s}/step_000008.ckpt", tmp_path / f"{s}.pt") for s in "AB")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name  # the outer step landed on both sites
    assert set(a["diloco"]) == {"outer", "momentum"} and a["diloco"]["momentum"]


def test_every_site_runs_the_slowest_sites_plan_or_the_job_is_refused_naming_each_sites_plan():
    config = TrainConfig(model=ModelConfig())
    config.data.global_batch = 16
    topology, profile = Topology.from_config("multi_site"), ModelProfile.from_gpt(ModelConfig())
    three = (("A",), ("B",), ("C",))
    pinned = one_plan_for_every_site(config, topology, three, profile, options=PlanOptions(), costs=MachineCosts())
    assert {p.split("=")[0] for p in pinned} == {
        f"strategy.{k}" for k in ("pp", "dp", "partition", "sharding", "schedule")
    }
    assert "strategy.partition=[3, 3]" in pinned
    two = (("A", "B"), ("C",))  # 4 ranks and 2: no plan holds rank i's shards alike
    with pytest.raises(ConfigError, match=r"no one plan fits every site \(site A\+B: .*; site C: "):
        one_plan_for_every_site(config, topology, two, profile, options=PlanOptions(), costs=MachineCosts())


@pytest.mark.slow
def test_a_users_script_runs_diloco_on_fsdp_shards_under_holmes_launch(tmp_path):
    """tests/user_script.py's DDP-style module (its own DataLoader split by `distributed_sampler_kwargs`, with a seed
    of its own) under `holmes-launch sites=auto`: FSDP2 inside each site, bf16 pseudo-gradients; at the last step (an
    outer step) both sites hold the same weights, their sharded outer state saved by DCP, and their replicas read
    data of their own."""
    script = ROOT / "tests" / "user_script.py"
    command = ["cluster=two_sites_1gbps", "sites=auto", "--", sys.executable, str(script), str(tmp_path), "diloco"]
    assert launch_main(command) == 0
    a, b = (weights(tmp_path / f"site-{s}/last.ckpt", tmp_path / f"{s}.pt") for s in "AB")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
        assert torch.equal(a["diloco"]["outer"][name], tensor), name  # the parameters took the outer ones
    losses = [json.loads((tmp_path / f"site-{s}/site-{s}-rank0.json").read_text()) for s in "AB"]
    assert len(losses[0]) == 6 and losses[0] != losses[1]
