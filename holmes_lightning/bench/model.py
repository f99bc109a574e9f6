"""What a bench trains: the recipe's GPT (`bench.model`) or a transformers causal LM through `HFCausalLM`
(`bench.hf_model`, on dict batches), built alike in the bench's process and in the lab's ranks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import lightning as L
import torch
from torch.distributed.fsdp import fully_shard

from holmes_lightning.cli.config import HFModelConfig, LoraSettings, ModelConfig
from holmes_lightning.cli.models import gpt, hf_causal_lm
from holmes_lightning.measure.profile import profile_modules
from holmes_lightning.planner import ModelProfile
from holmes_lightning.recipes.gpt import GPT
from holmes_lightning.runtime.contract import Inputs, dict_inputs

if TYPE_CHECKING:
    from holmes_lightning.bench.config import BenchSettings


class FlatFSDP:
    """A LightningModule under ModelParallelStrategy as a Lightning user shards it: FSDP2 per pipeline layer, then
    the root (mixed in before the model's class).

    With fully_shard's default, weights are freed after forward and gathered again for backward (two all-gathers and
    one reduce-scatter per step): what HolmesStrategy does without a pipeline (`Plan.reshard_after_forward`) and the
    planner's flat_fsdp alternative costs. Lightning's FSDPStrategy wraps torch's FSDP1, which refuses CPU devices.
    """

    def configure_model(self) -> None:
        for module in (*self.pipeline_layers(), self):
            fully_shard(module, mesh=self.device_mesh["data_parallel"])


@dataclass(frozen=True)
class BenchModel:
    """One of the two: `gpt` (the recipe's GPT in that shape) or `hf` (an HF config or pretrained directory)."""

    gpt: ModelConfig | None = None
    hf: HFModelConfig | None = None

    def __post_init__(self) -> None:
        if (self.gpt is None) == (self.hf is None):
            raise ValueError("BenchModel takes one of gpt= and hf=")

    @classmethod
    def trained_by(cls, settings: BenchSettings) -> BenchModel:
        """What a lab bench trains: `bench.hf_model` when given, else the GPT of `bench.model`."""
        return cls(hf=settings.hf_model) if settings.hf_model is not None else cls(gpt=settings.model)

    @classmethod
    def from_spec(cls, spec: dict) -> BenchModel:
        """The model a spec written by `spec()` (a lab rank's or a run's instructions) names."""
        if "hf_model" in spec:
            lora = LoraSettings(**spec["hf_model"]["lora"])
            return cls(hf=HFModelConfig(**{**spec["hf_model"], "lora": lora}))
        return cls(gpt=ModelConfig(**spec["model"]))

    def spec(self) -> dict:
        return {"hf_model": asdict(self.hf)} if self.hf is not None else {"model": asdict(self.gpt)}

    @property
    def name(self) -> str:
        return self.hf.name if self.hf is not None else self.gpt.name

    @property
    def seq_len(self) -> int:
        return self.hf.seq_len if self.hf is not None else self.gpt.seq_len

    @property
    def dict_batches(self) -> bool:
        """HF models train on dicts (input_ids, labels, attention_mask), the GPT on (inputs, targets)."""
        return self.hf is not None

    def build(self, flat_fsdp: bool = False) -> L.LightningModule:
        """The LightningModule on the current device; `flat_fsdp`: sharded per layer by ModelParallelStrategy."""
        if self.hf is not None:
            module = hf_causal_lm(self.hf)
            if not flat_fsdp:
                return module
            sharded = type(f"FlatFSDP{type(module).__name__}", (FlatFSDP, type(module)), {})
            return sharded(module.hf_model)  # the same HF model, its layers as initialised
        return gpt(self.gpt, type("FlatFSDPGPT", (FlatFSDP, GPT), {}) if flat_fsdp else GPT)

    def sample(self) -> Inputs | torch.Tensor:
        """One sequence as the first pipeline layer takes it."""
        ids = torch.zeros(1, self.seq_len, dtype=torch.long)
        return dict_inputs({"input_ids": ids}) if self.dict_batches else ids

    def profile(self) -> ModelProfile:
        """FLOPs (FlopCounterMode) and bytes of the pipeline layers on one sequence."""
        return profile_modules(self.build().pipeline_layers(), self.sample(), name=self.name)

    def describe(self) -> str:
        if self.hf is not None:
            fields = ", ".join(f"{key} {value}" for key, value in self.hf.config.items() if key != "model_type")
            kind = self.hf.config.get("model_type", self.hf.pretrained)
            return f"{self.name}: HF {kind} through HFCausalLM ({fields}; seq {self.seq_len})"
        model = self.gpt
        return (
            f"{self.name}: the recipe's GPT {model.n_layers}x{model.d_model} (heads {model.n_heads}, "
            f"seq {model.seq_len})"
        )
