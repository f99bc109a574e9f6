"""`python -m holmes_lightning.cli.plan`: the table, the picture, the JSON, and clear errors for bad settings."""

import itertools
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from holmes_lightning.cli.config import ConfigError, PlanJobConfig, register_configs
from holmes_lightning.cli.plan import run
from holmes_lightning.planner import Plan
from holmes_lightning.topology import config_dir

register_configs()


def composed(*overrides: str) -> PlanJobConfig:
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return OmegaConf.to_object(compose("plan", overrides=list(overrides)))


def test_cli_prints_the_plan_and_the_alternatives_and_draws_them(tmp_path, capsys):
    png, saved = tmp_path / "plan.png", tmp_path / "plan.json"
    plans = run(composed("cluster=two_cluster_mixed", "model=gpt_7_5b", f"plan.out={png}", f"plan.json={saved}"))
    out = capsys.readouterr().out
    for text in (
        "rank map",
        "stage 0: 0, 1",
        "A/infiniband",
        "B/roce",
        "rdma 180 Gb/s",  # 0.9 of InfiniBand's 200 Gb/s line rate
        "tcp 40 Gb/s",  # 0.4 of the 100 Gb/s Ethernet for NCCL over sockets
        "embedding..block17",
        "nic_unaware",
        "flat_fsdp",
        "homogeneous",
        "tokens/s",
        "TFLOPS/GPU",
    ):
        assert text in out, text
    assert png.stat().st_size > 20_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert Plan.from_json(saved.read_text()) == plans["holmes"]


def test_cli_passes_strategy_and_plan_settings_through():
    config = composed(
        "cluster=ib_only",
        "model=gpt_tiny",
        "strategy.schedule=GPipe",
        "strategy.pp=2",
        "strategy.partition=[2,4]",
        "data.global_batch=8",
        "strategy.costs.dp_overlap=0",
    )
    holmes = run(config)["holmes"]
    assert (holmes.schedule, holmes.pp, holmes.layers_per_stage()) == ("GPipe", 2, [2, 4])
    assert all(stage.exposed_sync_s == pytest.approx(stage.sync_s) for stage in holmes.stages)


def test_a_misspelled_key_is_rejected():
    with pytest.raises(ConfigCompositionException):
        composed("plan.outt=x.png")


@pytest.mark.slow
def test_module_entry_point_and_bad_input():
    ok = subprocess.run(
        [sys.executable, "-m", "holmes_lightning.cli.plan", "model=gpt_tiny", "cluster=ib_only"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert "Predicted step, same cost model" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "holmes_lightning.cli.plan", "cluster=three_cluster", "strategy.dp=3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0
    assert "dp=3: every stage must hold one NIC kind" in bad.stderr and "use dp in [1, 2]" in bad.stderr


def test_cli_shows_links_per_pair_of_clusters_and_what_the_search_did(capsys):
    plans = run(composed("cluster=multi_site", "model=gpt_small", "data.global_batch=24", "plan.verbose=true"))
    out = capsys.readouterr().out
    for text in ("inter_cluster:A<->B", "inter_cluster:B<->C", "A<->C", "10 Gb/s", "25 Gb/s", "search:", "simulated"):
        assert text in out, text
    order = [stage.clusters[0] for stage in plans["holmes"].stages]
    assert all({a, b} != {"A", "C"} for a, b in itertools.pairwise(order)), "the 10 Gb/s A-C link is no boundary"
    holmes = plans["holmes"].prediction.total_s
    assert all(holmes <= plans[name].prediction.total_s for name in ("uniform", "nic_unaware", "flat_fsdp"))


def test_paper_setting_prints_a_plan_no_worse_than_its_alternatives(capsys):
    plans = run(composed("cluster=paper_4ib_4roce", "model=gpt_7_5b"))
    holmes = plans["holmes"]
    for name in ("uniform", "nic_unaware", "flat_fsdp"):
        assert holmes.prediction.total_s <= plans[name].prediction.total_s, name
    assert holmes.prediction.total_s < plans["uniform"].prediction.total_s


def test_an_hf_model_is_planned_from_its_config_in_the_training_dtype(capsys):
    pytest.importorskip("transformers")
    shape = ["model.config.hidden_size=256", "model.config.intermediate_size=512", "model.config.num_hidden_layers=6"]
    bf16 = run(composed("cluster=two_cluster_mixed", "model=hf_llama", *shape))["holmes"]
    assert "HFDecoderLayer" in capsys.readouterr().out
    fp32 = run(composed("cluster=two_cluster_mixed", "model=hf_llama", "plan.bytes_per_value=4", *shape))["holmes"]
    assert sum(bf16.layers_per_stage()) == sum(fp32.layers_per_stage()) == 8  # embedding, 6 decoder layers, head
    assert fp32.prediction.memory_gb == pytest.approx(2 * bf16.prediction.memory_gb, rel=0.3)


def test_an_hf_model_with_a_lora_adapter_is_planned_with_its_share_of_trained_weights_shown(capsys):
    pytest.importorskip("peft")
    lora = run(composed("cluster=two_cluster_mixed", "model=hf_llama", "model.lora.r=4"))["holmes"]
    assert re.search(r"GB of weights \(1\.\d\d% of them trained\)", capsys.readouterr().out)  # q and v, rank 4
    whole = run(composed("cluster=two_cluster_mixed", "model=hf_llama"))["holmes"]
    assert "of them trained" not in capsys.readouterr().out
    assert lora.prediction.memory_gb < whole.prediction.memory_gb  # no gradients or AdamW states for the frozen


def test_your_own_module_is_planned_by_the_strategy_not_the_cli():
    with pytest.raises(ConfigError, match=r"model._target_=my_package.Model: the plan CLI plans the GPT"):
        run(composed("model=gpt_tiny", "model._target_=my_package.Model"))


def test_cli_puts_diloco_per_grouping_of_sites_next_to_one_pipeline(capsys):
    run(composed("cluster=multi_site", "model=gpt_small", "diloco.sync_every=50", "diloco.outer_bits=4"))
    out = capsys.readouterr().out
    assert "pseudo-gradients of 4 bits all-reduced every 50 steps" in out
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith(("pipeline ", "diloco "))]
    assert [row[:2] for row in rows] == [["pipeline", "one"], ["diloco", "A+B"], ["diloco", "A"]]
    run(composed("cluster=ib_only", "model=gpt_small"))
    assert "Across sites" not in capsys.readouterr().out  # one cluster: nothing to compare


def test_cli_refuses_bad_diloco_settings_naming_the_field():
    with pytest.raises(ConfigError, match="diloco.outer_bits=12: use 32, 16, 8 or 4"):
        composed("diloco.outer_bits=12")
