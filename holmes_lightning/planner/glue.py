"""Parameterless layers (activations, reshapes, pooling) planned with a neighbour that has parameters.

A stage's ranks build the module's optimizers over the parameters they hold, and torch refuses an empty list, so no
stage may hold only parameterless layers. The planner keeps every stage holding parameters by planning a profile in
which each parameterless layer is joined to the layer with parameters before it (those before the first such layer to
the one after them): stages then start only at a layer with parameters. The plan made on the joined profile is then
expanded back to the model's own layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

from holmes_lightning.planner.plan_types import Plan
from holmes_lightning.planner.profile import LayerProfile, ModelProfile


@dataclass(frozen=True)
class JoinedProfile:
    """`profile` of joined layers; `starts[u]`: the model's first layer in joined layer u (plus the layer count)."""

    profile: ModelProfile
    starts: tuple[int, ...]

    @classmethod
    def of(cls, profile: ModelProfile) -> JoinedProfile | None:
        """The profile with its parameterless layers joined to a neighbour; None where there is nothing to join (every
        layer holds parameters, or none does)."""
        holders = [i for i, layer in enumerate(profile.layers) if layer.param_bytes > 0]
        if not holders or len(holders) == profile.num_layers:
            return None
        starts = (0, *holders[1:], profile.num_layers)
        units = tuple(_joined(profile.layers[a:b]) for a, b in pairwise(starts))
        name = f"{profile.name} with its parameterless layers joined to a neighbour (a stage must hold parameters)"
        return cls(replace(profile, name=name, layers=units), starts)

    def expand(self, plan: Plan) -> Plan:
        """The plan over the model's own layers: each chunk's range of joined layers as the layers they hold."""
        stages = tuple(
            replace(stage, chunks=tuple((self.starts[a], self.starts[b]) for a, b in stage.chunks))
            for stage in plan.stages
        )
        return replace(plan, stages=stages, num_layers=self.starts[-1])


def _joined(layers: tuple[LayerProfile, ...]) -> LayerProfile:
    """Layers applied one after another as one: costs, weights and stash add up, the last one's output is sent."""
    measured = all(layer.measured for layer in layers)
    backward_flops = sum(layer.backward_flops for layer in layers)
    weight_flops = sum(layer.weight_share * layer.backward_flops for layer in layers)
    return LayerProfile(
        name="+".join(layer.name for layer in layers),
        forward_flops=sum(layer.forward_flops for layer in layers),
        backward_flops=backward_flops,
        param_bytes=sum(layer.param_bytes for layer in layers),
        frozen_bytes=sum(layer.frozen_bytes for layer in layers),
        activation_bytes=layers[-1].activation_bytes,
        stash_bytes=sum(layer.stash_bytes for layer in layers),
        forward_s=sum(layer.forward_s for layer in layers) if measured else None,
        backward_s=sum(layer.backward_s for layer in layers) if measured else None,
        weight_flops=weight_flops if backward_flops > 0 else None,  # else half, as for its one layer with weights
    )
