import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from holmes_lightning.cli.config import TrainConfig, register_configs
from holmes_lightning.topology import Topology, config_dir

register_configs()


def composed(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


def test_default_job_is_two_cluster_mixed():
    config = composed()
    assert config.cluster.name == "two_cluster_mixed"
    assert Topology.from_config(config.cluster).world_size == 4


def test_overrides_reach_the_topology():
    config = composed("cluster=three_cluster", "cluster.devices_per_node=2")
    assert Topology.from_config(config.cluster).world_size == 16


@pytest.mark.parametrize("override", ["cluster.devicez_per_node=2", "cluster.devices_per_node=two", "cluster=nope"])
def test_typos_and_wrong_types_are_errors(override):
    with pytest.raises(ConfigCompositionException):
        composed(override)


def test_train_script_parses_overrides():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "train.py", "cluster=ib_only", "--cfg", "job"], cwd=root, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "name: ib_only" in out.stdout
