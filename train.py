"""Main job: `python train.py cluster=two_cluster_mixed` (Hydra overrides, e.g. cluster.devices_per_node=2)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from holmes_lightning.config import TrainConfig, register_configs
from holmes_lightning.topology import Topology

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config: TrainConfig = OmegaConf.to_object(cfg)
    print(Topology.from_config(config.cluster))


if __name__ == "__main__":
    main()
