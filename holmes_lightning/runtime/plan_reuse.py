"""Same nodes, same plan: a resume runs the plan its checkpoint was saved on when nothing that fixes a plan changed.

Each launch calibrates afresh, and two near-equal splits can swap places with the machine's noise; a resume on another
split gives ranks other layers, whose dropout draws from random states saved for other layers, so its losses leave the
uninterrupted run's. A checkpoint's plan.json therefore also holds what its plan was made for (`PlanBasis`): the
cluster and the request that fix a plan apart from what the machine measured. A resume runs that plan again when the
job has as many ranks on the same cluster, as many pipeline layers and the same request (`replan_reasons` is empty);
otherwise it plans afresh and says why. A checkpoint saved before plans were stored with their basis just replans.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from holmes_lightning.planner import Plan
from holmes_lightning.topology import Topology


@dataclass(frozen=True)
class PlanBasis:
    """What a plan was made for, apart from what the machine measured, as JSON values: the cluster
    (`Topology.to_dict()`) and the request's settings that fix a plan (`PlanRequest.fixed_settings`), flat, with
    dotted keys for nested ones (`costs.dp_overlap`)."""

    cluster: dict[str, Any]
    request: dict[str, Any]

    @classmethod
    def of(cls, topology: Topology, settings: Mapping[str, Any]) -> PlanBasis:
        return cls(_as_json(topology.to_dict()), _flat(_as_json(settings)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanBasis:
        return cls(dict(data["cluster"]), dict(data["request"]))


def digest(value: Any) -> str:
    """A short fingerprint of a JSON-able value (a given profile: its settings would fill a page)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def replan_reasons(
    saved: Plan,
    made_for: Mapping[str, Any] | None,
    *,
    current: PlanBasis,
    world_size: int,
    num_layers: int,
    replica_batch: int | None = None,
) -> list[str]:
    """Why the plan `saved` (made for `made_for`) does not fit this job, in words; empty: run it again.

    This job: its basis `current`, its `world_size`, its model's `num_layers` pipeline layers and, where the
    DataLoader fixes the batch (no global batch asked for), the `replica_batch` it yields per DP replica.
    """
    if made_for is None:
        return ["the checkpoint does not say what its plan was made for (saved by an older version)"]
    stored = PlanBasis.from_dict(made_for)
    reasons = []
    if saved.world_size != world_size:
        reasons.append(f"{saved.world_size} ranks there, {world_size} here")
    elif stored.cluster != current.cluster:
        reasons.append(f"another cluster ({', '.join(_changed(stored.cluster, current.cluster))} differ)")
    if saved.num_layers != num_layers:
        reasons.append(f"{saved.num_layers} pipeline layers there, {num_layers} here")
    reasons += [
        f"{key}={stored.request.get(key)!r} there, {value!r} here"
        for key, value in current.request.items()
        if stored.request.get(key) != value
    ]
    if replica_batch is not None and replica_batch != saved.replica_batch:
        reasons.append(f"the DataLoader's batch_size={saved.replica_batch} there, {replica_batch} here")
    return reasons


def _changed(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The cluster settings (`spec.clusters`, `measured`, ...) that differ between two `Topology.to_dict()`s."""
    before, now = _flat(saved), _flat(current)
    return sorted(key for key in before.keys() | now.keys() if before.get(key) != now.get(key))


def _flat(data: Mapping[str, Any], depth: int = 2, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one, keys joined by dots, down to `depth` levels."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and depth > 1:
            flat.update(_flat(value, depth - 1, f"{name}."))
        else:
            flat[name] = value
    return flat


def _as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (enums as their values, tuples as lists), so saved and current compare."""
    return json.loads(json.dumps(value))
