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
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, PretrainedConfig

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a peft adapter's, as peft names it
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
    layer_keys: Sequence[HFKeys], layer_states: Mapping[int, Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The HF tensors of the layers in `layer_states` (layer index -> its full state dict): each HF key once, written
    by the first layer of the whole model that holds it (a tied weight by its first holder), if given here."""
    writer: dict[str, int] = {}
    for index, keys in enumerate(layer_keys):
        for hf_names in keys.values():
            writer.setdefault(hf_names[0], index)
    state: dict[str, torch.Tensor] = {}
    for index, tensors in sorted(layer_states.items()):
        missing = sorted(set(layer_keys[index]) - set(tensors))
        if missing:
            raise KeyError(f"the tensors of layer {index} lack {missing[:5]}")
        for name, hf_names in layer_keys[index].items():
            if writer[hf_names[0]] == index:
                state[hf_names[0]] = tensors[name]
    return state


def part_name(part: int, parts: int) -> str:
    """The safetensors file of part `part` (0-based) of `parts`, named as `save_pretrained` names its shards."""
    return WEIGHTS if parts == 1 else f"model-{part + 1:05d}-of-{parts:05d}.safetensors"


def write_part(directory: str | os.PathLike, state: Mapping[str, torch.Tensor], *, part: int, parts: int) -> str:
    """Write one part of the weights; returns its file name."""
    name = part_name(part, parts)
    Path(directory).mkdir(parents=True, exist_ok=True)
    tensors = {key: t.detach().to("cpu").contiguous() for key, t in state.items()}
    save_file(tensors, Path(directory) / name, metadata={"format": "pt"})
    return name


def write_adapter(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], config: Any) -> None:
    """A peft adapter as `PeftModel.save_pretrained` writes one: its tensors, and `adapter_config.json` from its
    `PeftConfig`."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    cpu = {key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}
    save_file(cpu, Path(directory) / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config.save_pretrained(directory)


class WrittenTensor(NamedTuple):
    """Where an HF tensor was written: its file, its bytes and dtype (`torch.float32`)."""

    file: str
    nbytes: int
    dtype: str


def write_index(directory: str | os.PathLike, written: Mapping[str, WrittenTensor]) -> None:
    """`model.safetensors.index.json` for weights written in several parts (HF's sharded layout)."""
    total = sum(tensor.nbytes for tensor in written.values())
    weight_map = {key: tensor.file for key, tensor in sorted(written.items())}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (Path(directory) / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_configs(
    directory: str | os.PathLike,
    *,
    config: PretrainedConfig,
    architecture: str,
    dtype: str,
    generation_config: GenerationConfig | None = None,
) -> None:
    """Write `config.json` and `generation_config.json` (when given), as `save_pretrained` does."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    config.dtype = dtype.removeprefix("torch.")
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
