"""Find the parts of a transformers decoder-only causal LM from its module structure and config, and cut it into
pipeline layers: `[HFEmbedding, HFDecoderLayer x num_hidden_layers, HFHead]`.

The parts: the decoder body (`get_decoder()`), its token embedding (`get_input_embeddings()`), its one ModuleList of
decoder layers, its rotary module (a child holding an `inv_freq` buffer, or one without parameters called with
position ids: GPT-J's and CodeGen's sin/cos tables), learned position embeddings (other `nn.Embedding` children),
embedding dropout (`nn.Dropout` children), the final norm (the one child left that holds tensors, or the one child
left: OLMo's norm has no weights) and the LM head (`get_output_embeddings()`). Scalars the families' forwards apply
come from the config.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from itertools import chain

from torch import nn
from transformers import PretrainedConfig

from holmes_lightning.hf.layers import MASKS, HFDecoderLayer, HFEmbedding, HFHead

HAND_WRITTEN = (
    "write `pipeline_layers()` by hand instead: return modules [embedding, *decoder layers, head] where the first "
    "is called as layer(input_ids, attention_mask, position_ids), every other one as layer(*previous_output), each "
    "but the last returns (hidden_states, attention_mask, position_ids) and the last returns logits; "
    "holmes_lightning.hf.layers has wrappers (HFEmbedding, HFDecoderLayer, HFHead) to build them from"
)


class UnrecognisedModelError(ValueError):
    """hf_pipeline_layers could not find a part of the model; the message names it and how to split by hand."""


def hf_pipeline_layers(hf_model: nn.Module) -> list[nn.Module]:
    """Cut a transformers decoder-only `*ForCausalLM` into pipeline layers that reuse its submodules.

    Applied in order (layer 0 as `layer(input_ids, attention_mask, position_ids)`, then `layer(*out)`) they give
    `hf_model(input_ids, attention_mask=..., position_ids=...).logits`, with the cache off.
    """
    name = type(hf_model).__name__
    if not callable(getattr(hf_model, "get_decoder", None)):
        raise UnrecognisedModelError(f"{name} is not a transformers PreTrainedModel (no get_decoder()); {HAND_WRITTEN}")
    config = hf_model.config
    decoder = hf_model.get_decoder()
    tokens = hf_model.get_input_embeddings()
    lm_head = hf_model.get_output_embeddings()
    if lm_head is None:
        raise UnrecognisedModelError(f"{name} has no LM head (get_output_embeddings() is None); {HAND_WRITTEN}")
    children = {n: c for n, c in decoder.named_children() if c is not tokens and c is not lm_head}
    blocks = _decoder_layers(name, children)
    rotaries = _pop_all(children, _is_rotary)
    positions = _pop_all(children, lambda c: isinstance(c, nn.Embedding))
    dropouts = _pop_all(children, lambda c: isinstance(c, nn.Dropout))
    holders = {n: c for n, c in children.items() if next(chain(c.parameters(), c.buffers()), None) is not None}
    holders = holders or children  # a norm without weights (OLMo's) where it is the one child left
    if len(holders) != 1 or any(len(found) > 1 for found in (rotaries, positions, dropouts)):
        found = ", ".join(f"{n} ({type(c).__name__})" for n, c in decoder.named_children())
        raise UnrecognisedModelError(
            f"{name}: expected in its decoder ({type(decoder).__name__}: {found}) exactly one final norm besides the "
            f"token embedding and decoder layers, and at most one rotary module, position embedding and dropout; "
            f"found norms {list(holders) or 'none'}, rotary modules {list(rotaries) or 'none'}, position embeddings "
            f"{list(positions) or 'none'}, dropouts {list(dropouts) or 'none'}; {HAND_WRITTEN}"
        )
    (norm,) = holders.values()
    position = next(iter(positions.values()), None)
    dropout = next(iter(dropouts.values()), None)
    rotary = next(iter(rotaries.values()), None)
    if position is not None and type(position).forward is not nn.Embedding.forward:
        raise UnrecognisedModelError(
            f"{name}: its position embedding {type(position).__name__} has its own forward (not indexed by "
            f"position ids); {HAND_WRITTEN}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnrecognisedModelError(f"{name}: use_bidirectional_attention is not supported; {HAND_WRITTEN}")
    layer_types = _layer_types(name, decoder.config, len(blocks))
    rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    layers = [
        HFEmbedding(tokens, position, dropout, getattr(decoder.config, "embedding_multiplier", None)),
        *(
            HFDecoderLayer(block, decoder.config, layer_type, rotary, rotary_by_type)
            for block, layer_type in zip(blocks, layer_types, strict=True)
        ),
        HFHead(
            norm,
            lm_head,
            logit_scale=getattr(config, "logit_scale", None),
            logits_divisor=getattr(config, "logits_scaling", None),
            softcap=getattr(config, "final_logit_softcapping", None),
        ),
    ]
    _name_hf_keys(hf_model, layers)
    return layers


def _decoder_layers(name: str, children: dict[str, nn.Module]) -> nn.ModuleList:
    lists = {n: c for n, c in children.items() if isinstance(c, nn.ModuleList)}
    if len(lists) != 1:
        raise UnrecognisedModelError(
            f"{name}: expected its decoder to hold the decoder layers as its one nn.ModuleList child, found "
            f"{list(lists) or 'none'}; {HAND_WRITTEN}"
        )
    (key,) = lists
    return children.pop(key)


def _is_rotary(child: nn.Module) -> bool:
    """A rotary module: it holds `inv_freq`, or it has no parameters and its forward takes position ids."""
    if any(n.endswith("inv_freq") for n, _ in child.named_buffers()):
        return True
    takes_positions = "position_ids" in inspect.signature(child.forward).parameters
    return takes_positions and not isinstance(child, nn.Embedding) and next(child.parameters(), None) is None


def _pop_all(children: dict[str, nn.Module], matches: Callable[[nn.Module], bool]) -> dict[str, nn.Module]:
    found = {n: c for n, c in children.items() if matches(c)}
    for n in found:
        del children[n]
    return found


def _layer_types(name: str, config: PretrainedConfig, count: int) -> list[str]:
    """Per layer: `config.layer_types` where the config has them, else sliding everywhere when it sets a window."""
    default = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    layer_types = list(getattr(config, "layer_types", None) or [default] * count)[:count]
    unknown = sorted(set(layer_types) - set(MASKS))
    if unknown:
        raise UnrecognisedModelError(
            f"{name}: layer types {unknown} are not supported (only {list(MASKS)}); {HAND_WRITTEN}"
        )
    return layer_types


def _name_hf_keys(hf_model: nn.Module, layers: list[nn.Module]) -> None:
    """Set each layer's `hf_keys`; every tensor of the model must be in some layer."""
    keys_by_tensor: dict[int, list[str]] = defaultdict(list)
    for key, tensor in hf_model.state_dict(keep_vars=True).items():
        keys_by_tensor[id(tensor)].append(key)
    covered = set()
    for layer in layers:
        layer.hf_keys = {n: tuple(keys_by_tensor[id(t)]) for n, t in layer.state_dict(keep_vars=True).items()}
        covered |= {id(t) for t in chain(layer.parameters(), layer.buffers())}
    stray = [n for n, t in chain(hf_model.named_parameters(), hf_model.named_buffers()) if id(t) not in covered]
    if stray:
        raise UnrecognisedModelError(
            f"{type(hf_model).__name__}: tensors {stray[:5]} belong to no part found (token embedding, decoder "
            f"layers, rotary, position embedding, dropout, final norm, LM head); {HAND_WRITTEN}"
        )
