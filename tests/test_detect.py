import warnings
from pathlib import Path

import pytest

from holmes_lightning.topology import NICKind, detect_node_nic, detect_ports
from holmes_lightning.topology.detect import reconcile


def make_port(root: Path, device: str, port: int, layer: str, rate: str, state: str = "4: ACTIVE") -> None:
    folder = root / device / "ports" / str(port)
    folder.mkdir(parents=True)
    (folder / "link_layer").write_text(layer + "\n")
    (folder / "rate").write_text(rate + "\n")
    (folder / "state").write_text(state + "\n")


def test_infiniband_hca(tmp_path):
    make_port(tmp_path, "mlx5_0", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    make_port(tmp_path, "mlx5_1", 1, "InfiniBand", "400 Gb/sec (4X NDR)")
    assert detect_node_nic(tmp_path) == (NICKind.infiniband, 400.0)
    assert [p.device for p in detect_ports(tmp_path)] == ["mlx5_0", "mlx5_1"]


def test_roce_is_an_rdma_device_with_ethernet_link_layer(tmp_path):
    make_port(tmp_path, "mlx5_0", 1, "Ethernet", "100 Gb/sec (4X EDR)")
    assert detect_node_nic(tmp_path) == (NICKind.roce, 100.0)


def test_down_ports_are_ignored(tmp_path):
    make_port(tmp_path, "mlx5_0", 1, "InfiniBand", "200 Gb/sec (4X HDR)", state="1: DOWN")
    make_port(tmp_path, "mlx5_1", 1, "Ethernet", "25 Gb/sec (1X EDR)")
    assert detect_node_nic(tmp_path) == (NICKind.roce, 25.0)


def test_no_rdma_device_means_ethernet(tmp_path):
    assert detect_node_nic(tmp_path / "missing") == (NICKind.ethernet, None)


def test_unreadable_rate_gives_unknown_speed(tmp_path):
    make_port(tmp_path, "mlx5_0", 1, "InfiniBand", "garbage")
    assert detect_node_nic(tmp_path) == (NICKind.infiniband, None)


def test_pinned_kind_wins_with_a_warning():
    with pytest.warns(UserWarning, match="config says nic.kind='infiniband' but sysfs shows 'roce'"):
        assert reconcile("infiniband", NICKind.roce, "cluster 'A'") is NICKind.infiniband
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reconcile(None, NICKind.roce, "cluster 'A'") is NICKind.roce
        assert reconcile("roce", NICKind.roce, "cluster 'A'") is NICKind.roce
