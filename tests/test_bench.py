"""The benchmark's planning and reporting without the lab (the runs: `python -m holmes_lightning.bench`), and the
memory bench's activation checkpointing runs at a small size (on loopback, no lab needed)."""

import json
import re
from dataclasses import replace

import pytest

from holmes_lightning.bench import overhead, planning, sites
from holmes_lightning.bench.bubbles import draw_schedules, schedule_record, schedule_table
from holmes_lightning.bench.calibrate import LabCalibration, calibrate
from holmes_lightning.bench.config import SITES_VARIANTS, VARIANTS, ActivationsJob, BenchSettings, SitesJob
from holmes_lightning.bench.load import CpuClock
from holmes_lightning.bench.memory import run_memory_bench
from holmes_lightning.bench.model import BenchModel, FlatFSDP
from holmes_lightning.bench.overhead import OverheadRun, pair_ratios
from holmes_lightning.bench.report import Target, draw, markdown, regime, repeated_runs, targets, write_json
from holmes_lightning.bench.runner import Launch, RunResult, pipeline_shares, summarize
from holmes_lightning.bench.variants import REFERENCE, Hardware, Variant, plan_schedule_variants, plan_variants
from holmes_lightning.cli.config import ConfigError, HFModelConfig, ModelConfig, StrategyConfig
from holmes_lightning.measure import available_cores
from holmes_lightning.measure.calibration import Calibration
from holmes_lightning.planner import BatchSettings, MachineCosts, PlanOptions, compare_plans
from holmes_lightning.topology import Topology


def test_every_variant_is_planned_and_reported(tmp_path, saved_figures):
    settings = BenchSettings(model=ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=16), global_batch=8)
    profile = BenchModel(gpt=settings.model).profile()
    costs = MachineCosts(efficiency=1.0, layer_overhead_s=1e-3, optimizer_s_per_gb=5.0, dp_overlap=0.0)
    calibration = LabCalibration(Calibration(10.0, 4e-3, 5e-3, 0.5, 5e-3, costs), 1e-4, "test")
    hardware = Hardware.derive(Topology.from_config("two_cluster_mixed"), settings, calibration)
    variants = plan_variants(hardware, profile, settings, PlanOptions(pp=2))
    assert [v.name for v in variants] == list(VARIANTS)
    plans = {v.name: v.plan for v in variants}
    assert {p.global_batch for p in plans.values()} == {8}
    assert (plans["holmes_hybrid"].pp, plans["fsdp"].pp, plans["ddp"].sharding) == (2, 1, "none")
    assert plans["holmes_hybrid"].sharding == "none"  # auto on gloo: replicas move 2/3 of FSDP's bytes
    assert plans["fsdp"].prediction.optimizer_s == pytest.approx(5.0 * profile.param_bytes / 4 / 1e9)
    assert plans["nic_unaware"].layout == "nic_unaware" and hardware.unequal.nodes[2].nic_gbps == 50
    slow = [s for s in plans["holmes_unequal"].stages if s.clusters == ("B",)][0]  # fewer layers than a uniform split
    assert len(slow.layers) < profile.num_layers / 2

    steps = settings.warmup_steps + settings.measured_steps
    per_rank = {v.name: [[v.plan.prediction.total_s] * steps] * 4 for v in variants}  # runs exactly as predicted
    unpipelined = {v.name: [[]] * 4 for v in variants}
    launched = Launch(per_rank, 0.0, unpipelined, unpipelined)
    results = [summarize(v, launched, settings=settings, profile=profile) for v in variants]
    assert {(r.passes_share, r.waits_share) for r in results} == {(None, None)}
    check = regime(variants, profile, settings.global_batch)
    assert check["gradient_to_boundary"] > 5
    context = {"calibration": calibration, "variants": variants, "bench": "test", "model": "m"}
    context.update(global_batch=8, steps="1 + 1", prediction_tolerance=0.15)
    table = markdown(results, context, check)
    assert "Per schedule" not in table  # no bench.schedules
    refused = {"DualPipeV": "it needs more micro-batches"}
    with_schedules = markdown(results, {**context, "schedule_runs": [], "refused_schedules": refused}, check)
    assert with_schedules.endswith("\nDualPipeV: not run, it needs more micro-batches\n")
    assert all(v.label in table for v in variants) and "| predicted / measured within 15% | 7/7 runs" in table
    assert "Other work took" not in table
    busy = [replace(r, foreign_load=0.3) if r.name == "ddp" else r for r in results]
    assert "Other work took over 10% of the machine's cores during: ddp (30%)" in markdown(busy, context, check)
    measured = {t.name: t.value for t in targets(results)}
    hybrid = plans["holmes_hybrid"].prediction.total_s
    assert measured["Holmes hybrid / FSDPStrategy"] == pytest.approx(plans["fsdp"].prediction.total_s / hybrid)
    write_json(tmp_path / "r.json", results, context=context, check=check)
    written = json.loads((tmp_path / "r.json").read_text())
    assert len(written["runs"]) == 7
    earlier_schema = (  # the calibration's keys in the JSON of earlier runs (docs/benchmark/short.json)
        "gflops pass_overhead_s optimizer_s share device_tflops layer_overhead_s optimizer_s_per_gb bandwidth_scale "
        "scale_reason fsdp_layer_s fsdp_reshard_layer_s fsdp_optimizer_layer_s latency_s device shared_cores "
        "transfer_cpu_s_per_byte"
    )
    assert set(earlier_schema.split()) <= set(written["calibration"])

    drawn = [replace(r, median_s=r.median_s * (1 + i / 10)) for i, r in enumerate(results)]  # unlike the predictions
    draw(tmp_path / "r.png", drawn)
    (figure,) = saved_figures
    (axes,) = figure.axes
    measured, predicted = axes.containers
    assert [bar.get_height() for bar in measured] == pytest.approx([r.median_s for r in drawn])
    assert [bar.get_height() for bar in predicted] == pytest.approx([r.predicted_s for r in drawn])
    reference = next(r.median_s for r in drawn if r.name == REFERENCE)
    assert [text.get_text() for text in axes.texts] == [f"{r.median_s / reference:.2f}x" for r in drawn]


def test_each_schedule_asked_for_is_planned_run_and_reported_with_its_bubble(tmp_path, saved_figures):
    settings = BenchSettings(
        model=ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=16),
        global_batch=4,
        schedules=["ZBVZeroBubble", "1F1B", "DualPipeV"],
    )
    profile = BenchModel(gpt=settings.model).profile()
    costs = MachineCosts(efficiency=1.0, layer_overhead_s=1e-3, optimizer_s_per_gb=5.0, dp_overlap=0.0)
    calibration = LabCalibration(Calibration(10.0, 4e-3, 5e-3, 0.5, 5e-3, costs), 1e-4, "test")
    hardware = Hardware.derive(Topology.from_config("two_cluster_mixed"), settings, calibration)
    runs, refused = plan_schedule_variants(hardware, profile, settings, PlanOptions(pp=2))
    assert [(r.name, r.label, r.plan.schedule.value, r.plan.pp) for r in runs] == [
        ("holmes_schedule_ZBVZeroBubble", "Holmes, ZBVZeroBubble", "ZBVZeroBubble", 2),
        ("holmes_schedule_1F1B", "Holmes, 1F1B", "1F1B", 2),
    ]
    assert list(refused) == ["DualPipeV"] and "microbatches >= virtual stages" in refused["DualPipeV"]  # 2 per dp
    assert plan_schedule_variants(hardware, profile, replace(settings, schedules=None), PlanOptions()) == ([], {})

    steps = settings.warmup_steps + settings.measured_steps
    step = {r.name: [[1.0] * steps] * 4 for r in runs}
    schedule_s = {r.name: [[0.9] * steps] * 4 for r in runs}
    passes_s = {r.name: [[0.6] * steps, [0.7] * steps, [0.5] * steps, [0.6] * steps] for r in runs}
    launched = Launch(step, 0.0, schedule_s, passes_s)
    results = [summarize(r, launched, settings=settings, profile=profile) for r in runs]
    assert [(r.passes_share, r.waits_share) for r in results] == [pytest.approx((0.7, 0.2))] * 2  # the busiest rank
    table = "\n".join(schedule_table(results, refused))
    zbv = results[0].predicted
    row = f"| ZBVZeroBubble | {results[0].layout} | 1.000 | {results[0].predicted_s:.3f} | 0.70 | "
    assert row + f"{zbv['compute_s'] / zbv['total_s']:.2f} | 0.20 |" in table
    assert f"DualPipeV: not run, {refused['DualPipeV']}" in table
    written = json.loads(json.dumps(schedule_record(results, refused)))
    assert [run["waits_share"] for run in written["runs"]] == pytest.approx([0.2, 0.2])
    assert written["runs"][0]["predicted_shares"]["bubble"] == pytest.approx(zbv["bubble_s"] / zbv["total_s"])
    assert written["refused"] == refused
    draw_schedules(tmp_path / "s.png", results)
    (axes,) = saved_figures[0].axes
    waits, idle, bubble = axes.containers
    assert [bar.get_height() for bar in waits] == pytest.approx([0.2, 0.2])
    assert [text.get_text() for text in axes.texts] == ["1.00 s", "1.00 s"]


def test_pipeline_shares_are_the_busiest_ranks_after_the_warm_up():
    steps = [[9.0, 2.0, 2.0], [9.0, 2.0, 4.0]]  # per rank; the first step a warm-up
    schedule_s = [[9.0, 1.5, 1.5], [9.0, 1.8, 3.0]]
    passes_s = [[1.0, 1.0, 1.0], [1.0, 0.5, 2.0]]  # rank 0 the busiest in step 1, rank 1 in step 2
    assert pipeline_shares(steps, schedule_s, passes_s, warmup_steps=1) == pytest.approx(((0.5 + 0.5) / 2, 0.25))
    assert pipeline_shares(steps, [[], []], [[], []], warmup_steps=1) is None


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match="bench.variants"):
        BenchSettings(variants=["holmes", "fsdp"])
    with pytest.raises(ConfigError, match="bench.repeats"):
        BenchSettings(kind="overhead", variants=["plain", "holmes"], repeats=0)


def _overhead_run(model: str, variant: str, repeat: int, tokens_per_s: float) -> OverheadRun:
    return OverheadRun(model, variant, repeat, (1.0,), 1.0, 0.0, tokens_per_s)


def test_the_overhead_ratio_pairs_the_runs_that_ran_next_to_each_other():
    runs = [
        _overhead_run("gpt", "plain", 0, 100.0),
        _overhead_run("gpt", "holmes", 0, 99.0),
        _overhead_run("gpt", "plain", 1, 50.0),
        _overhead_run("gpt", "holmes", 1, 51.0),
    ]
    unfinished = _overhead_run("gpt", "plain", 2, 10.0)
    assert pair_ratios([*runs, unfinished]) == [0.99, 1.02]  # an unfinished pair counts for nothing


def test_the_overhead_report_judges_each_model_on_its_own_pairs(tmp_path):
    hf = HFModelConfig(name="tiny_llama", config={"model_type": "llama", "hidden_size": 64}, seq_len=32)
    settings = BenchSettings(kind="overhead", variants=["plain", "holmes"], hf_model=hf)
    assert list(overhead.models(settings)) == [settings.model.name, "tiny_llama"]
    runs = [
        _overhead_run(settings.model.name, "plain", 0, 100.0),
        _overhead_run(settings.model.name, "holmes", 0, 99.0),
        _overhead_run("tiny_llama", "plain", 0, 100.0),
        _overhead_run("tiny_llama", "holmes", 0, 90.0),
    ]
    report = overhead.markdown(runs, settings)
    gpt_part, hf_part = report.split("## ")[1:]
    assert "median 0.990 (target >= 0.98: met)" in gpt_part and "HF llama through HFCausalLM" in hf_part
    assert "median 0.900 (target >= 0.98: NOT met)" in hf_part
    overhead.draw(tmp_path / "overhead.png", runs)
    assert (tmp_path / "overhead.png").stat().st_size > 0


@pytest.mark.slow
def test_a_lab_rank_is_calibrated_on_the_benchmark_gpt(tmp_path, monkeypatch):
    monkeypatch.setenv("HOLMES_CALIBRATION_DIR", str(tmp_path))
    model = BenchModel(gpt=ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=8))
    profile = model.profile()
    pair = Topology.from_config({"name": "pair", "clusters": [{"name": "a", "nodes": 2, "nic": {"kind": "roce"}}]})
    lab = calibrate(pair, profile, model, seconds=0, scale=1e-3, assumed=MachineCosts(dp_overlap=0.0))
    calibration = lab.calibration
    assert calibration.gflops > 0 and calibration.pass_overhead_s >= 0 and calibration.optimizer_s > 0
    assert calibration.device_tflops == pytest.approx(calibration.gflops * calibration.share / 1e3)
    per_layer = calibration.pass_overhead_s / profile.num_layers / calibration.share
    assert calibration.costs.layer_overhead_s == pytest.approx(per_layer)
    assert calibration.costs.latency_s > 0  # two ranks started for it
    assert calibration.costs.dp_overlap == 0.0  # not measured: as assumed
    assert calibration.transfer_cpu_s_per_byte > 0  # and two in the lab, one sending the other 128 MB
    assert (lab.bandwidth_scale, lab.scale_reason) == (1e-3, "bench.bandwidth_scale")


def run_result(name: str, median_s: float, network: str = "net") -> RunResult:
    """A run of Holmes that measured `median_s` per step."""
    return RunResult(
        name=name,
        label=name,
        strategy="holmes",
        network=network,
        layout="pp=2 x dp=2",
        step_s=(median_s,),
        median_s=median_s,
        tokens_per_s=1.0,
        tflops_per_device=1.0,
        predicted_s=median_s,
        predicted={},
    )


@pytest.mark.parametrize(
    ("target", "met"),
    [
        (Target("t", "a", "b", value=None, minimum=1.0), None),  # a run missing: no verdict
        (Target("t", "a", "b", value=0.97, minimum=0.97), True),
        (Target("t", "a", "b", value=0.969, minimum=0.97), False),
        (Target("t", "a", "b", value=1.09, expected=1.0, tolerance=0.1), True),
        (Target("t", "a", "b", value=0.91, expected=1.0, tolerance=0.1), True),
        (Target("t", "a", "b", value=0.89, expected=1.0, tolerance=0.1), False),
        (Target("t", "a", "b", value=1.25, expected=1.14, tolerance=0.1), True),
        (Target("t", "a", "b", value=1.26, expected=1.14, tolerance=0.1), False),
        (Target("t", "a", "b", value=1.5, minimum=1.2, expected=1.4, tolerance=0.1), True),
        (Target("t", "a", "b", value=1.3, minimum=1.35, expected=1.4, tolerance=0.1), False),  # in range, too low
    ],
)
def test_a_target_is_met_above_its_minimum_and_within_its_tolerance(target, met):
    assert target.met is met
    assert target.needed != "-"


def test_with_a_reference_the_targets_are_the_reference_ratios():
    measured = [run_result("holmes_hybrid", 2.0), run_result("holmes_homogeneous", 1.98), run_result("fsdp", 2.5)]
    check = {"reference": "paper", "reference_ratios": {"fsdp": 1.14, "nic_unaware": 1.02}}
    by_run = {t.slower: t for t in targets(measured, check)}
    assert by_run["holmes_homogeneous"].minimum == 0.97 and by_run["holmes_homogeneous"].met is True
    assert by_run["fsdp"].value == pytest.approx(1.25) and by_run["fsdp"].met is True  # 1.25 / 1.14 = 1.096
    assert by_run["nic_unaware"].met is None  # not run
    short = {t.slower: t for t in targets(measured)}
    assert short["holmes_homogeneous"].minimum == 0.90 and short["fsdp"].met is False  # short bench: >= 3x


def test_other_work_is_the_machine_busy_time_the_bench_did_not_spend():
    before = CpuClock(wall_s=100.0, busy_s=50.0, ours_s=10.0)
    assert before.foreign_share(CpuClock(wall_s=110.0, busy_s=65.0, ours_s=20.0)) == pytest.approx(
        5.0 / (10.0 * available_cores())
    )
    assert before.foreign_share(CpuClock(wall_s=110.0, busy_s=55.0, ours_s=20.0)) == 0.0  # never below nothing
    assert before.foreign_share(before) == 0.0
    now = CpuClock.now()
    assert now.busy_s > 0 and now.ours_s > 0


def test_runs_of_one_configuration_show_how_much_the_machine_varied():
    topology = Topology.from_config("two_cluster_mixed")
    profile = BenchModel(gpt=ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=16)).profile()
    compared = compare_plans(topology, profile, BatchSettings(8), options=PlanOptions(pp=2))
    holmes, unaware = compared["holmes"], compared["nic_unaware"]
    assert (holmes.pp, holmes.dp, holmes.layers_per_stage()) == (unaware.pp, unaware.dp, unaware.layers_per_stage())
    plans = {"first": holmes, "elsewhere": unaware, "again": holmes}  # NIC-unaware: the same ranks, groups on TCP
    variants = [Variant(name=name, strategy="holmes", topology=topology, plan=p) for name, p in plans.items()]
    runs = [run_result("first", 2.0), run_result("elsewhere", 2.0), run_result("again", 2.2)]
    (line,) = repeated_runs(runs, variants)
    assert line.startswith("first and again ran the same configuration") and "(+10.0%)" in line


def test_a_bench_trains_the_hf_model_when_given_one():
    hf = HFModelConfig(
        name="tiny_llama",
        seq_len=16,
        config={
            "model_type": "llama",
            "vocab_size": 256,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
        },
    )
    settings = BenchSettings(hf_model=hf, variants=["holmes_hybrid", "fsdp"])
    trained = BenchModel.trained_by(settings)
    assert BenchModel.from_spec(json.loads(json.dumps(trained.spec()))) == trained
    assert trained.name == "tiny_llama" and trained.seq_len == 16 and trained.dict_batches
    assert trained.profile().num_layers == 4  # embedding, two decoder layers, head
    sharded = trained.build(flat_fsdp=True)
    assert type(sharded).__mro__[1:3] == (FlatFSDP, type(trained.build()))
    assert [p.shape for p in sharded.parameters()] == [p.shape for p in trained.build().parameters()]
    assert BenchModel.trained_by(BenchSettings()).name == BenchSettings().model.name


def test_benches_that_size_the_gpt_refuse_an_hf_model():
    hf = HFModelConfig(config={"model_type": "llama"})
    with pytest.raises(ConfigError, match="bench.hf_model with bench.kind=memory"):
        BenchSettings(kind="memory", variants=["memory_fsdp"], hf_model=hf)


@pytest.mark.slow
def test_the_memory_bench_measures_checkpointing_lower_with_the_same_losses(tmp_path):
    """bench=memory's AC runs at a small size: 4 layers of width 64 over 512 tokens, 2 micro-batches of 8 sequences.
    Its weights are ~1 MB, so the ranks' ~15 MB of memory the estimate leaves out (threads, pipeline buffers, backward
    temporaries) is a large part of what they measure: here the estimate is compared with off, not judged."""
    long = ModelConfig(name="long", n_layers=4, d_model=64, n_heads=2, seq_len=512)
    settings = BenchSettings(
        name="memory",
        kind="memory",
        variants=["memory_fsdp_ac_off", "memory_fsdp_ac_full"],
        activations=ActivationsJob(model=long, global_batch=32, microbatches=2),
        warmup_steps=1,
        measured_steps=1,  # the second step's peak holds AdamW's states
    )
    requested = StrategyConfig(pp=2, partition=[3, 3])  # two blocks a stage: activations on every rank
    rows, table = run_memory_bench(Topology.from_config("two_cluster_mixed"), settings, requested, tmp_path)
    runs = {(row.checkpointing, row.rank): row for row in rows}
    assert sorted(runs) == [(mode, rank) for mode in ("full", "off") for rank in range(4)]
    for rank in range(4):
        off, full = runs["off", rank], runs["full", rank]
        assert full.model_gb < off.model_gb - 0.01 and full.estimate_gb < off.estimate_gb  # 10 MB less at least
        assert len(full.losses) == 2 and full.losses == pytest.approx(off.losses, rel=1e-6)
    written = json.loads((tmp_path / "memory.json").read_text())
    assert [row["checkpointing"] for row in written["rows"]] == ["off"] * 4 + ["full"] * 4
    for rank in range(4):  # each step's schedule call and its passes, timed on every rank (`worker.PassTimer`)
        (run,) = json.loads((tmp_path / "memory_fsdp_ac_full" / f"rank{rank}.json").read_text())["runs"]
        timed = zip(run["passes_s"], run["schedule_s"], run["step_s"], strict=True)
        assert len(run["step_s"]) == 2 and all(0 < passes < schedule < step for passes, schedule, step in timed)
    assert "full / off, model memory per rank: measured" in table and (tmp_path / "memory.png").stat().st_size > 10_000


def test_the_planning_bench_sites_differ_by_link_and_plan(tmp_path):
    """bench.planning's eight sites: each pair on its own WAN link (its configured Gb/s as line rate, never above
    either site's NIC); the small sizes plan and write their table and chart."""
    sites = next(shape for shape in planning.SHAPES if shape.pairs)
    topology = sites.topology(sites.smallest)
    per_site = sites.smallest // 8
    assert len({rank // per_site for rank in range(topology.world_size)}) == 8
    for i, j, gbps in sites.pairs:
        nics = sites.clusters[i][1], sites.clusters[j][1]
        assert topology.link(i * per_site, j * per_site).line_gbps == min(gbps, *nics)
    timings = planning.main([str(tmp_path), "--repeats", "1", "--max-gpus", "64"])
    assert [t.gpus for t in timings] == [64] * (len(planning.SHAPES) - 1)
    assert (tmp_path / "planning.png").stat().st_size > 0


def test_the_planning_bench_times_each_schedule_asked_for(tmp_path, capsys):
    """`--schedules` plans every size with each (its name in the table and JSON); `--shapes`, `--gpus` and `--model`
    pick what is planned; words no shape's name holds are refused, naming the shapes."""
    argv = [str(tmp_path), "--repeats", "1", "--shapes", "IB + RoCE", "--gpus", "64", "--model", "gpt_1_3b"]
    timings = planning.main([*argv, "--schedules", "GPipe", "ZBVZeroBubble"])
    assert [(t.shape, t.gpus, t.model, t.schedule) for t in timings] == [
        ("2 clusters (IB + RoCE)", 64, "gpt_1_3b", schedule) for schedule in ("GPipe", "ZBVZeroBubble")
    ]
    written = json.loads((tmp_path / "planning.json").read_text())
    assert [row["schedule"] for row in written] == ["GPipe", "ZBVZeroBubble"]
    assert "| ZBVZeroBubble |" in (tmp_path / "planning.md").read_text()
    with pytest.raises(SystemExit):
        planning.main([str(tmp_path), "--shapes", "nine sites"])
    assert "--shapes nine sites: no shape's name contains them" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ({"sync_every": [5], "overlap_steps": 8}, "bench.sites.sync_every=[5]"),
        ({"sync_every": [200]}, "below bench.sites.max_steps=120"),
        ({"short_steps": 0}, "bench.sites.short_steps=0"),
        ({"cluster": "nowhere"}, "bench.sites.cluster='nowhere'"),
    ],
)
def test_bad_sites_bench_settings_name_the_field(job, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SitesJob(**job)
    with pytest.raises(ConfigError, match="give bench.sites exactly when bench.kind=sites"):
        BenchSettings(kind="sites", variants=["diloco"])


def test_sites_bench_runs_each_variant_with_its_overrides_and_reads_tokens_per_second(tmp_path):
    job = SitesJob(sync_every=[10, 50])
    runs = sites.variants(BenchSettings(kind="sites", variants=list(SITES_VARIANTS), sites=job), job)
    assert list(runs) == ["homogeneous", "pipeline", "flat_dp", "diloco_h10", "diloco_h50"]
    assert runs["homogeneous"] == ["cluster.inter_cluster.gbps=200.0"]  # the WAN as fast as the clusters' NICs
    assert "strategy.layout=flat_fsdp" in runs["flat_dp"] and "diloco.sync_every=50" in runs["diloco_h50"]
    metrics = tmp_path / "metrics.csv"
    rows = ["step,train/samples,train/time,train_loss", "0,8,1.0,", "0,,,3.0", "9,80,5.0,", "9,,,2.0"]
    metrics.write_text("\n".join(rows) + "\n")
    assert sites.tokens_per_s(metrics, seq_len=128) == pytest.approx(72 * 128 / 4.0)
    assert sites.read_losses(metrics) == {0: 3.0, 9: 2.0}
