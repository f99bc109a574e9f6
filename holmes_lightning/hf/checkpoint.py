"""HF safetensors directories, layer by layer: read one pipeline layer's tensors from a local directory (sharded or
not, only that layer's keys), and write the layers' full tensors as a directory `from_pretrained` loads.

Layers name their tensors by their own `state_dict()` keys; `hf_keys` (one mapping per layer, from
`hf_pipeline_layers`) gives each the HF keys of that tensor, the one HF saves first (tied weights have several).
"""

from __future__ import annotations

import copy
import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, PretrainedConfig

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HFKeys = Mapping[str, Sequence[str]]  # a layer's state-dict key -> the HF keys of that tensor


class SafetensorsCheckpoint:
    """The safetensors weights of a local HF directory; `read` opens only the files holding the keys asked for."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / WEIGHTS_INDEX
        single = self.directory / WEIGHTS
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: self.directory / name for key, name in weight_map.items()}
        elif single.is_file():
            with safe_open(single, framework="pt") as weights:
                self.files = dict.fromkeys(weights.keys(), single)
        else:
            raise FileNotFoundError(f"{self.directory} holds neither {WEIGHTS} nor {WEIGHTS_INDEX}")

    def read(self, hf_keys: HFKeys) -> dict[str, torch.Tensor]:
        """For each of a layer's keys, the tensor stored under the first of its HF keys the checkpoint holds."""
        chosen = {name: next((k for k in keys if k in self.files), None) for name, keys in hf_keys.items()}
        missing = [hf_keys[name][0] for name, key in chosen.items() if key is None]
        if missing:
            raise KeyError(f"{self.directory} holds no tensor for {missing[:5]}")
        by_file: dict[Path, dict[str, str]] = defaultdict(dict)
        for name, key in chosen.items():
            by_file[self.files[key]][name] = key
        tensors = {}
        for path, keys in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as weights:
                tensors.update({name: weights.get_tensor(key) for name, key in keys.items()})
        return tensors


def hf_state_dict(
    layer_keys: Sequence[HFKeys], layer_states: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The HF state dict of all layers' full tensors (`layer_states[i]`: layer i's state dict); tied weights once."""
    if len(layer_states) != len(layer_keys):
        raise ValueError(f"got the tensors of {len(layer_states)} layers; the model has {len(layer_keys)}")
    state: dict[str, torch.Tensor] = {}
    for index, (keys, tensors) in enumerate(zip(layer_keys, layer_states, strict=True)):
        missing = sorted(set(keys) - set(tensors))
        if missing:
            raise KeyError(f"the tensors of layer {index} lack {missing[:5]}")
        for name, hf_names in keys.items():
            state.setdefault(hf_names[0], tensors[name])
    return state


def write_pretrained(
    directory: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    *,
    config: PretrainedConfig,
    architecture: str,
    generation_config: GenerationConfig | None = None,
) -> None:
    """Write `config.json`, `generation_config.json` (when given) and `model.safetensors`, as `save_pretrained` does."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    config.dtype = str(next(t.dtype for t in state.values() if t.is_floating_point())).removeprefix("torch.")
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    tensors = {key: t.detach().to("cpu").contiguous() for key, t in state.items()}
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})
