"""NIC detection from sysfs: InfiniBand vs RoCE (`link_layer`) and port rate; Ethernet when no RDMA device exists."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from holmes_lightning.topology.spec import NICKind

SYSFS_INFINIBAND = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class DetectedPort:
    device: str
    port: int
    kind: NICKind
    gbps: float | None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _rate_gbps(text: str | None) -> float | None:
    """Parse sysfs `rate`, e.g. "200 Gb/sec (4X HDR)"."""
    match = re.match(r"\s*([0-9.]+)\s*Gb", text or "")
    return float(match.group(1)) if match else None


def detect_ports(sysfs_root: str | Path = SYSFS_INFINIBAND) -> list[DetectedPort]:
    """Every active RDMA port under `sysfs_root` (one folder per device, `ports/<n>/{link_layer,rate,state}`)."""
    ports = []
    for port_dir in sorted(Path(sysfs_root).glob("*/ports/*")):
        layer = (_read(port_dir / "link_layer") or "").lower()
        state = _read(port_dir / "state") or "ACTIVE"
        if "ACTIVE" not in state.upper() or layer not in ("infiniband", "ethernet"):
            continue
        kind = NICKind.infiniband if layer == "infiniband" else NICKind.roce
        port = int(port_dir.name) if port_dir.name.isdigit() else 0
        ports.append(DetectedPort(port_dir.parent.parent.name, port, kind, _rate_gbps(_read(port_dir / "rate"))))
    return ports


def detect_node_nic(sysfs_root: str | Path = SYSFS_INFINIBAND) -> tuple[NICKind, float | None]:
    """The node's fabric: InfiniBand if any IB port is active, else RoCE, else Ethernet (rate unknown)."""
    ports = detect_ports(sysfs_root)
    for kind in (NICKind.infiniband, NICKind.roce):
        rates = [p.gbps for p in ports if p.kind is kind and p.gbps]
        if any(p.kind is kind for p in ports):
            return kind, (max(rates) if rates else None)
    return NICKind.ethernet, None


def reconcile(configured: str | None, detected: NICKind, where: str) -> NICKind:
    """The config pins a kind; detection only fills it in. A disagreement is warned about, never silent."""
    if configured is None:
        return detected
    pinned = NICKind(configured)
    if pinned is not detected:
        warnings.warn(
            f"{where}: config says nic.kind={pinned.value!r} but sysfs shows {detected.value!r}; using the config. "
            f"Set nic.kind: null to use detection, or fix the config.",
            stacklevel=2,
        )
    return pinned
