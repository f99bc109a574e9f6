"""`HFCausalLM`: a transformers decoder-only causal LM as a LightningModule that HolmesStrategy can pipeline.

Batches are dicts as HF's data collators make them: `input_ids` and `labels` (B, T), optionally `attention_mask`
and `position_ids`. The loss is HF's causal-LM loss: labels shifted inside it, -100 not counted.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from huggingface_hub import snapshot_download
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from holmes_lightning import init_layers
from holmes_lightning.hf.checkpoint import (
    SafetensorsCheckpoint,
    WrittenTensor,
    hf_state_dict,
    write_adapter,
    write_configs,
    write_index,
    write_part,
)
from holmes_lightning.hf.structure import hf_pipeline_layers, keys_by_tensor

IGNORE_INDEX = -100  # labels HF's loss does not count


def counted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many tokens HF's causal-LM loss counts: the labels after the shift that are not -100."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's `ForCausalLMLoss`: mean float32 cross-entropy of logits[t] against labels[t + 1]; 0 when none counts."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    summed = F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return summed / counted_tokens(labels).clamp(min=1)


class HFCausalLM(L.LightningModule):
    """A transformers decoder-only `*ForCausalLM`, trained on dict batches with AdamW.

    `source`: a model instance (trained from its weights), a `PretrainedConfig` (random weights: HF's initialisation,
    each pipeline layer from its own seed), or a local directory or hub name (weights read layer by layer from its
    safetensors). Build it under the meta device (`with torch.device("meta"):`) and HolmesStrategy allocates only a
    rank's layers and fills them with `init_layer`. The HF model (`hf_model`) is not a registered submodule: its
    tensors are those of `layers`, the pipeline layers, which the strategy keeps or drops per stage.

    `peft_config`: an adapter (peft's `LoraConfig`, ...) to wrap the model in with `get_peft_model`, which then
    trains the adapter alone. Where the model's weights are initialised here (from a config or directory, or on the
    meta device), each layer's LoRA adapter is initialised after its base weights, as peft does: LoRA's B at zero,
    DoRA's magnitudes from the loaded weights, `modules_to_save` copies from their originals.
    """

    def __init__(
        self,
        source: nn.Module | PretrainedConfig | str | os.PathLike,
        *,
        peft_config: Any = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["source", "peft_config"])  # objects loggers cannot write: pass them again
        self.pretrained: SafetensorsCheckpoint | None = None
        if isinstance(source, nn.Module):
            hf_model = source
        elif isinstance(source, PretrainedConfig):
            hf_model = AutoModelForCausalLM.from_config(source)
        else:
            directory = _local_directory(source)
            self.pretrained = SafetensorsCheckpoint(directory)
            hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        base_keys = keys_by_tensor(hf_model)  # before an adapter wraps modules: the names checkpoints give them
        if peft_config is not None:
            hf_model = _with_adapter(hf_model, peft_config)
        if not isinstance(source, nn.Module) or any(p.is_meta for p in hf_model.parameters()):
            _check_adapter_initialisable(hf_model)
        self.__dict__["hf_model"] = hf_model  # unregistered (see the class docstring)
        self.layers = nn.ModuleList(hf_pipeline_layers(hf_model))
        self.layer_hf_keys = [layer.hf_keys for layer in self.layers]  # kept when the strategy drops layers
        for layer in self.layers if self.pretrained else ():  # the keys the directory holds: none for an adapter's
            tensors = layer.state_dict(keep_vars=True).items()
            layer.base_keys = {n: base_keys[id(t)] for n, t in tensors if id(t) in base_keys}
        if not isinstance(source, nn.Module):
            init_layers(self)  # each layer from its own seed, or from the checkpoint; on meta, the strategy does it

    def pipeline_layers(self) -> list[nn.Module]:
        """[embedding, decoder layer x num_hidden_layers, head]; see `holmes_lightning.hf.layers`."""
        return list(self.layers)

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """HF's causal-LM loss of one micro-batch: the mean over its counted tokens."""
        return causal_lm_loss(logits, labels)

    def pipeline_loss_weight(self, labels: torch.Tensor) -> torch.Tensor:
        """The number of tokens `pipeline_loss` averages over (int64)."""
        return counted_tokens(labels)

    @torch.no_grad()
    def init_layer(self, layer: nn.Module) -> None:
        """Fill one pipeline layer: from the checkpoint when built from one, else with HF's `_init_weights` over its
        modules, children first as in HF's `initialize_weights` (a tied weight keeps its first holder's values, as HF
        initialises it once: `init_layers` sees to that). Then its adapter, from those weights, as peft does."""
        if self.pretrained is None:
            layer.apply(self.hf_model._init_weights)
        else:
            self._load(layer)
        _init_adapters(layer, getattr(self.hf_model, "peft_config", {}))

    def _load(self, layer: nn.Module) -> None:
        """The layer's tensors from the checkpoint; those no checkpoint holds (rotary frequencies, embedding scales:
        non-persistent buffers) from HF's `_init_weights`."""
        for module in layer.modules():
            if module._non_persistent_buffers_set:
                self.hf_model._init_weights(module)
        tensors = layer.state_dict(keep_vars=True)
        for name, value in self.pretrained.read(layer.base_keys).items():
            tensors[name].copy_(value)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) of the layers applied in order; absent mask and positions filled as HF (and the runtime)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
        out = (input_ids, attention_mask, position_ids)
        for layer in self.layers:
            out = layer(*out)
        return out

    def _loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
        return self.pipeline_loss(logits, batch["labels"])

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.dim() >= 2]  # weights and embeddings decay; biases, norms don't
        vectors = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=hp.learning_rate, betas=hp.betas, fused=True)

    def save_pretrained(
        self, directory: str | os.PathLike, layer_states: Sequence[Mapping[str, torch.Tensor]] | None = None
    ) -> None:
        """Write an HF directory (`AutoModelForCausalLM.from_pretrained` loads it) from each layer's full tensors, in
        this process (across ranks: `HolmesStrategy.save_hf`).

        `layer_states[i]`: pipeline layer i's state dict, gathered in full; default: the layers here (all of them).
        """
        if layer_states is None:
            layer_states = [layer.state_dict() for layer in self.layers]
        written = self.save_pretrained_part(directory, dict(enumerate(layer_states)), part=0, parts=1)
        self.finish_pretrained(directory, written)

    def save_pretrained_part(
        self,
        directory: str | os.PathLike,
        layer_states: Mapping[int, Mapping[str, torch.Tensor]],
        *,
        part: int,
        parts: int,
    ) -> dict[str, WrittenTensor | torch.Tensor]:
        """Write the HF tensors of these pipeline layers (layer index -> full state dict) as part `part` of `parts`:
        each HF key once, by the first layer of the model that holds it (a tied weight by its first holder). Of a
        peft model (LoRA, ...), only its adapter's tensors, which are returned to `finish_pretrained` unwritten."""
        state, adapter = hf_state_dict(self.layer_hf_keys, layer_states), _adapter_name(self.hf_model)
        if adapter is not None:
            from peft.utils import get_peft_model_state_dict

            # peft asks every module it trains whole (`modules_to_save`) for its tensors: those of other parts are
            # stood in for on the meta device, and left out of what it returns
            elsewhere = {
                names[0]: torch.empty(0, device="meta") for keys in self.layer_hf_keys for names in keys.values()
            }
            tensors = get_peft_model_state_dict(self.hf_model, {**elsewhere, **state}, adapter)
            return {key: tensor.detach().to("cpu") for key, tensor in tensors.items() if not tensor.is_meta}
        name = write_part(directory, state, part=part, parts=parts)
        return {key: WrittenTensor(name, t.numel() * t.element_size(), str(t.dtype)) for key, t in state.items()}

    def finish_pretrained(
        self, directory: str | os.PathLike, written: Mapping[str, WrittenTensor | torch.Tensor]
    ) -> None:
        """The index of a directory written in several parts, and `config.json` (and `generation_config.json` where
        the model generates). Of a peft model, its adapter as peft saves one (`PeftModel.from_pretrained(base,
        directory)` loads it): the adapter tensors `written` holds, and `adapter_config.json`."""
        adapter = _adapter_name(self.hf_model)
        if adapter is not None:
            write_adapter(directory, written, replace(self.hf_model.peft_config[adapter], inference_mode=True))
            return
        if len({tensor.file for tensor in written.values()}) > 1:
            write_index(directory, written)
        hf_model = self.hf_model
        write_configs(
            directory,
            config=hf_model.config,
            architecture=type(hf_model).__name__,
            dtype=next(tensor.dtype for tensor in written.values() if "float" in tensor.dtype),
            generation_config=hf_model.generation_config if hf_model.can_generate() else None,
        )


def _adapter_name(hf_model: nn.Module) -> str | None:
    """The active adapter of a peft model (`get_peft_model`), else None."""
    return getattr(hf_model, "active_adapter", None) if hasattr(hf_model, "peft_config") else None


def _with_adapter(hf_model: nn.Module, peft_config: Any) -> nn.Module:
    """`get_peft_model(hf_model, peft_config)`; a model that already has an adapter is refused."""
    if _adapter_name(hf_model) is not None:
        raise ValueError(
            "HFCausalLM got peft_config for a model that already has an adapter (a peft model): pass the base model "
            "with peft_config, or the peft model without it"
        )
    try:
        from peft import get_peft_model
    except ImportError as missing:
        raise ImportError("HFCausalLM(peft_config=...) needs peft: pip install peft") from missing
    with warnings.catch_warnings():  # peft 0.22 reads an attribute transformers 5 deprecates; nothing the user can do
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(hf_model, peft_config)


def _check_adapter_initialisable(hf_model: nn.Module) -> None:
    """Of the adapters of a model whose weights are initialised here, only LoRA's, which `_init_adapters`
    initialises layer by layer, are accepted."""
    adapter = _adapter_name(hf_model)
    if adapter is None:
        return
    config = hf_model.peft_config[adapter]
    if config.peft_type != "LORA":  # peft's PeftType, a str enum
        raise ValueError(
            f"HFCausalLM initialises the weights of a model built from a config, a directory or on the meta device "
            f"layer by layer, and only LoRA adapters with them, not {type(config).__name__}: build the base model on "
            f"a real device (e.g. AutoModelForCausalLM.from_pretrained), then get_peft_model, then HFCausalLM"
        )


def _init_adapters(layer: nn.Module, peft_configs: Mapping[str, Any]) -> None:
    """Initialise the adapters in a layer as `get_peft_model` does, from the base weights it now holds: each LoRA
    adapter made anew by its layer's `update_layer` (B at zero, DoRA's magnitudes the weights' norms, as its config
    says) and each `modules_to_save` copy from its original."""
    if not peft_configs:
        return
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    for module in list(layer.modules()):
        if isinstance(module, LoraLayer):
            for name in list(module.r):
                module.update_layer(name, module.r[name], lora_alpha=module.lora_alpha[name], config=peft_configs[name])
        elif isinstance(module, ModulesToSaveWrapper):
            for trained in module.modules_to_save.values():
                trained.load_state_dict(module.original_module.state_dict())


def _local_directory(source: str | os.PathLike) -> Path:
    """`source` itself when it is a directory, else the hub model of that name (its json and safetensors files)."""
    if Path(source).is_dir():
        return Path(source)
    return Path(snapshot_download(str(source), allow_patterns=["*.json", "*.safetensors"]))
