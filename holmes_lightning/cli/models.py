"""What train.py trains: the GPT recipe (`model=gpt_*`), a transformers causal LM through `HFCausalLM` (`model=hf_*`:
random weights from the HF config written in its YAML, or `model.pretrained=DIR`), or your LightningModule
(`model._target_=...`).

`check_model` runs before any rank starts and returns the profile the launcher's plan check plans with: the GPT's
analytic one; an HF model's pipeline layers built from its config on the meta device and profiled (FLOPs and bytes
from shapes: its layers, widths, vocabulary and `model.seq_len`); None for your module, whose layers are known only
once a rank builds it (the ranks then profile and plan it). `build_model` builds the model on a rank, GPT and HF
models on the meta device, so that each rank allocates (or reads from the pretrained safetensors) only its stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch

from holmes_lightning.cli.config import ConfigError, HFModelConfig, ModelConfig, TrainConfig, error_line
from holmes_lightning.cli.targets import build_target, check_target
from holmes_lightning.measure.profile import profile_modules
from holmes_lightning.planner import ModelProfile
from holmes_lightning.recipes import GPT
from holmes_lightning.runtime.contract import dict_inputs

HF_EXTRA = "pip install 'holmes-lightning[hf]' (or pip install transformers)"


def check_model(config: TrainConfig, arguments: Mapping[str, Any], data_vocab: int | None) -> ModelProfile | None:
    """The model's profile for the plan check (None for your own module), once what can be checked before any rank
    starts is: your class imports and takes its arguments; an HF model builds, fits `model.seq_len` and has a
    vocabulary of at least `data_vocab` (what the data's tokens need; None: unknown)."""
    model = config.model
    target = None if isinstance(model, HFModelConfig) else model._target_
    check_target("model", target, L.LightningModule, arguments)
    if isinstance(model, HFModelConfig):
        return hf_profile(model, data_vocab=data_vocab)
    return None if target is not None else ModelProfile.from_gpt(model)


def build_model(config: TrainConfig, arguments: Mapping[str, Any]) -> L.LightningModule:
    """This rank's LightningModule (GPT and HF models on the meta device: the strategy materialises its stage)."""
    model, opt = config.model, config.trainer
    if isinstance(model, HFModelConfig):
        with torch.device("meta"):
            return hf_causal_lm(model, learning_rate=opt.learning_rate, weight_decay=opt.weight_decay)
    if model._target_ is not None:
        return build_target(model._target_, arguments)
    with torch.device("meta"):  # no storage yet: each rank allocates and initialises only its stage's layers
        return gpt(
            model,
            learning_rate=opt.learning_rate,
            warmup_steps=opt.warmup_steps,
            weight_decay=opt.weight_decay,
        )


def gpt(model: ModelConfig, cls: type[GPT] = GPT, **hyperparameters: Any) -> GPT:
    """The recipe's GPT (or a subclass of it) in the configured shape, on the current device."""
    return cls(
        n_layers=model.n_layers,
        d_model=model.d_model,
        n_heads=model.n_heads,
        seq_len=model.seq_len,
        vocab_size=model.vocab_size,
        dropout=model.dropout,
        **hyperparameters,
    )


def hf_causal_lm(model: HFModelConfig, **hyperparameters: Any) -> L.LightningModule:
    """`HFCausalLM` of the configured HF model, built on the current device (meta: the strategy fills each stage)."""
    return _hf_module(model)(_hf_source(model), peft_config=_lora_config(model), **hyperparameters)


def flops_per_sample(module: L.LightningModule, profile: ModelProfile | None) -> float | None:
    """Training FLOPs of one sequence for the throughput monitor: the GPT's formula, an HF model's profile; None for
    your module (it may define `flops_per_batch` itself)."""
    if isinstance(module, GPT):
        return module.flops_per_token * module.hparams.seq_len
    return None if profile is None else profile.flops_per_sample


def _hf_module(model: HFModelConfig) -> type[L.LightningModule]:
    try:
        from holmes_lightning.hf import HFCausalLM
    except ImportError as error:
        raise ConfigError(f"model={model.name} needs transformers ({error}), an optional extra: {HF_EXTRA}") from None
    return HFCausalLM


def _hf_source(model: HFModelConfig) -> Any:
    """What HFCausalLM is built from: the pretrained directory, else an HF config of the fields in `model.config`."""
    if model.pretrained is not None:
        if not Path(model.pretrained).is_dir():
            raise ConfigError(f"model.pretrained={model.pretrained}: no such directory; give a local HF directory")
        return model.pretrained
    from transformers import CONFIG_MAPPING

    values = dict(model.config)
    model_type = values.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"model.config.model_type={model_type}: not a transformers model type (e.g. llama, qwen2)")
    config_class = CONFIG_MAPPING[model_type]
    unknown = sorted(set(values) - {*config_class().to_dict(), *config_class.attribute_map})
    if unknown:
        raise ConfigError(f"model.config.{unknown[0]}: not a field of {config_class.__name__}; check its spelling")
    try:
        return config_class(**values)
    except Exception as error:  # transformers' validators raise their own types; all mean a value that cannot work
        reason = str(error).strip().splitlines()[-1].strip()  # the last line says why; the first names the validator
        raise ConfigError(f"model.config: {reason}") from None


def _lora_config(model: HFModelConfig) -> Any:
    """peft's `LoraConfig` of `model.lora`, or None for r=0 (no adapter)."""
    if model.lora.r == 0:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise ConfigError(f"model.lora.r={model.lora.r}: an adapter needs peft: pip install peft") from None
    try:
        return LoraConfig(**asdict(model.lora))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model.lora: {error_line(error)}") from None


def hf_profile(model: HFModelConfig, *, data_vocab: int | None = None, bytes_per_value: int = 4) -> ModelProfile:
    """Build the model on the meta device (nothing allocated, nothing read but configs and safetensors headers) and
    profile its pipeline layers on one sequence of `model.seq_len` tokens, in fp32 or (`bytes_per_value=2`) bf16;
    checked against the positions it takes and the data's vocabulary (`data_vocab`, None: unknown)."""
    hf_module = _hf_module(model)
    source = _hf_source(model)
    where = f"model.pretrained={model.pretrained}" if model.pretrained is not None else f"model={model.name}"
    try:
        with torch.device("meta"):
            module = hf_module(source, peft_config=_lora_config(model))
    except (OSError, ValueError) as error:  # no config.json or weights, a family that cannot be cut into layers
        raise ConfigError(f"{where}: {error_line(error)}") from None
    hf_config = module.hf_model.config
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is not None and model.seq_len > positions:
        raise ConfigError(f"model.seq_len={model.seq_len}: above the model's max_position_embeddings={positions}")
    if data_vocab is not None and hf_config.vocab_size < data_vocab:
        raise ConfigError(
            f"{where}: a vocabulary of {hf_config.vocab_size} tokens, but the data's (bytes, or the tokenizer's) has "
            f"{data_vocab}; give the model a vocab_size of at least {data_vocab}"
        )
    if bytes_per_value == 2:
        module.to(torch.bfloat16)
    sample = dict_inputs({"input_ids": torch.zeros(1, model.seq_len, dtype=torch.long)})
    return profile_modules(module.pipeline_layers(), sample, name=model.name)
