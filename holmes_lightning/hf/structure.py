"""Find the parts of a transformers decoder-only causal LM from its module structure and config, and cut it into
pipeline layers: `[HFEmbedding, HFDecoderLayer x num_hidden_layers, HFHead]`.

The parts: the decoder body (`get_decoder()`), its token embedding (`get_input_embeddings()`), its one ModuleList of
decoder layers, its rotary module (a child holding an `inv_freq` buffer, or one without parameters called with
position ids: GPT-J's and CodeGen's sin/cos tables), learned position embeddings (other `nn.Embedding` children,
OPT's indexed at position id + its `offset`), embedding dropout (`nn.Dropout` children), OPT's `project_in` /
`project_out`, the norms (the children left: one the decoder's forward applies before its layers normalises the
embeddings, BLOOM's; one after them the last hidden states; OLMo's has no weights) and the LM head
(`get_output_embeddings()`). Scalars the families' forwards apply come from the config; decoder layers that take
`alibi` get BLOOM's ALiBi biases. What the decoder's forward does beyond these parts cannot be seen in its structure,
so what can be is checked: each norm applied once, no tensor outside the parts saved or read by the forward, and no
decoder-layer input that only the model's forward makes. A model failing a check is refused, naming the part.
"""

from __future__ import annotations

import inspect
import re
import sys
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
    blocks_key, blocks = _decoder_layers(name, children)
    projections = {n: children.pop(n) for n in ("project_in", "project_out") if isinstance(children.get(n), nn.Linear)}
    rotaries = _pop_all(children, _is_rotary)
    positions = _pop_all(children, lambda c: isinstance(c, nn.Embedding))
    dropouts = _pop_all(children, lambda c: isinstance(c, nn.Dropout))
    embedding_norm, final_norm = _norms(name, decoder, children, blocks_key)
    no_final_norm = final_norm is None and "project_out" not in projections  # OPT-350m ends in its projection
    if no_final_norm or any(len(found) > 1 for found in (rotaries, positions, dropouts)):
        raise UnrecognisedModelError(
            f"{name}: expected in its decoder {_listed(decoder)} a final norm besides the token embedding and decoder "
            f"layers, and at most one rotary module, position embedding and dropout; found "
            f"{'no' if no_final_norm else 'a'} final norm, rotary modules {list(rotaries) or 'none'}, position "
            f"embeddings {list(positions) or 'none'}, dropouts {list(dropouts) or 'none'}; {HAND_WRITTEN}"
        )
    position = next(iter(positions.values()), None)
    rotary = next(iter(rotaries.values()), None)
    if position is not None and type(position).forward is not nn.Embedding.forward and _offset(position) is None:
        raise UnrecognisedModelError(
            f"{name}: its position embedding {type(position).__name__} has its own forward (not indexed by "
            f"position ids, nor by position ids + an integer `offset`); {HAND_WRITTEN}"
        )
    alibi = _block_inputs(name, blocks[0], rotary) if len(blocks) else None
    if getattr(config, "alibi", False) and alibi is None:
        raise UnrecognisedModelError(
            f"{name}: alibi=True, whose biases its model's forward folds into the attention mask; {HAND_WRITTEN}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnrecognisedModelError(f"{name}: use_bidirectional_attention is not supported; {HAND_WRITTEN}")
    layer_types = _layer_types(name, decoder.config, len(blocks))
    rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    layers = [
        HFEmbedding(
            tokens,
            project_in=projections.get("project_in"),
            positions=position,
            multiplier=getattr(decoder.config, "embedding_multiplier", None),
            norm=embedding_norm,
            dropout=next(iter(dropouts.values()), None),
        ),
        *(
            HFDecoderLayer(block, decoder.config, layer_type, rotary, rotary_by_type, alibi)
            for block, layer_type in zip(blocks, layer_types, strict=True)
        ),
        HFHead(
            final_norm,
            lm_head,
            project_out=projections.get("project_out"),
            logit_scale=getattr(config, "logit_scale", None),
            logits_divisor=getattr(config, "logits_scaling", None),
            softcap=getattr(config, "final_logit_softcapping", None),
        ),
    ]
    _name_hf_keys(hf_model, layers)
    return layers


def _decoder_layers(name: str, children: dict[str, nn.Module]) -> tuple[str, nn.ModuleList]:
    lists = {n: c for n, c in children.items() if isinstance(c, nn.ModuleList)}
    if len(lists) != 1:
        raise UnrecognisedModelError(
            f"{name}: expected its decoder to hold the decoder layers as its one nn.ModuleList child, found "
            f"{list(lists) or 'none'}; {HAND_WRITTEN}"
        )
    (key,) = lists
    return key, children.pop(key)


def _norms(
    name: str, decoder: nn.Module, children: dict[str, nn.Module], layers_key: str
) -> tuple[nn.Module | None, nn.Module | None]:
    """The children left once the other parts are taken are norms: the one the decoder's forward applies before its
    decoder layers normalises the embeddings (BLOOM's), the one it applies after them the last hidden states. A norm
    without weights (OLMo's) counts where it is the one child left. Each must be applied once (NanoChat applies its
    norm before the layers and after them)."""
    holders = {n: c for n, c in children.items() if next(chain(c.parameters(), c.buffers()), None) is not None}
    holders = holders or children
    source = _forward_source(decoder)
    layers = re.search(rf"self\.{layers_key}\b", source)
    layers_at = layers.start() if layers else -1
    before = [n for n in holders if -1 < source.find(f"self.{n}(") < layers_at]
    after = [n for n in holders if n not in before]
    twice = [n for n in holders if source.count(f"self.{n}(") > 1]
    unlike = [n for n, c in holders.items() if not _takes_one_input(c)]
    if len(before) > 1 or len(after) > 1 or twice or unlike:
        raise UnrecognisedModelError(
            f"{name}: expected in its decoder {_listed(decoder)} at most one norm applied before "
            f"its decoder layers and one after them, each once; found norms before {before or 'none'}, after "
            f"{after or 'none'}, applied more than once {twice or 'none'}, taking more than one input "
            f"{unlike or 'none'}; {HAND_WRITTEN}"
        )
    return next((holders[n] for n in before), None), next((holders[n] for n in after), None)


def _takes_one_input(module: nn.Module) -> bool:
    """Whether the module's forward has exactly one required argument, as a norm's."""
    parameters = inspect.signature(module.forward).parameters.values()
    return sum(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters) == 1


def _listed(decoder: nn.Module) -> str:
    """The decoder's class and children, for an error: `(LlamaModel: embed_tokens (Embedding), ...)`."""
    children = ", ".join(f"{n} ({type(c).__name__})" for n, c in decoder.named_children())
    return f"({type(decoder).__name__}: {children})"


def _forward_source(module: nn.Module) -> str:
    """The source of the module's forward, or "" where Python has none."""
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _offset(position: nn.Module) -> int | None:
    """The integer `offset` a position embedding adds to position ids (OPT's 2), or None."""
    offset = getattr(position, "offset", None)
    return offset if isinstance(offset, int) else None


def _block_inputs(name: str, block: nn.Module, rotary: nn.Module | None) -> Callable | None:
    """Check that a decoder layer needs no input but those HFDecoderLayer gives it: hidden states, the 4-D mask,
    position ids, rotary cos/sin where a rotary module was found, and ALiBi biases where it takes `alibi` (BLOOM's).
    Returns the ALiBi builder, its modeling module's `build_alibi_tensor(attention_mask,
    num_heads, dtype)` (which the HF model calls once per forward), or None."""
    parameters = inspect.signature(block.forward).parameters
    if rotary is not None and "position_embeddings" not in parameters:
        raise UnrecognisedModelError(
            f"{name}: its decoder layer {type(block).__name__} takes no position_embeddings for what looks like a "
            f"rotary module ({type(rotary).__name__}); {HAND_WRITTEN}"
        )
    given = {"attention_mask", "position_ids", "position_embeddings", "alibi"}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    missing = [  # the first argument is the hidden states, whatever its name
        n
        for n, p in list(parameters.items())[1:]
        if p.kind in positional and p.default is inspect.Parameter.empty and n not in given
    ]
    build = None
    if "alibi" in parameters:
        build = getattr(sys.modules[type(block).__module__], "build_alibi_tensor", None)
        missing += [] if build else ["alibi (its module has no build_alibi_tensor)"]
    if missing:
        raise UnrecognisedModelError(
            f"{name}: its decoder layer {type(block).__name__} needs {missing}, which only its model's forward "
            f"makes; {HAND_WRITTEN}"
        )
    return build


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


def keys_by_tensor(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Each tensor's keys in the model's state dict (a tied weight has several), by the tensor's id."""
    keys: dict[int, list[str]] = defaultdict(list)
    for key, tensor in model.state_dict(keep_vars=True).items():
        keys[id(tensor)].append(key)
    return {tensor: tuple(names) for tensor, names in keys.items()}


def _name_hf_keys(hf_model: nn.Module, layers: list[nn.Module]) -> None:
    """Set each layer's `hf_keys`; every tensor the model saves or reads must be in some layer."""
    saved = keys_by_tensor(hf_model)
    covered = set()
    for layer in layers:
        layer.hf_keys = {n: saved.get(id(t), ()) for n, t in layer.state_dict(keep_vars=True).items()}
        covered |= {id(t) for t in chain(layer.parameters(), layer.buffers())}
    stray = [n for n, t in hf_model.state_dict(keep_vars=True).items() if id(t) not in covered]
    # A buffer that is not saved, outside every part, counts where the forward holding it reads it (CTRL's position
    # table), not where it does not (GPT-BigCode's causal-mask table).
    for module in {hf_model, hf_model.get_decoder()}:
        source = _forward_source(module)
        unsaved = (n for n, t in module.named_buffers(recurse=False) if id(t) not in covered | set(saved))
        stray += [n for n in unsaved if re.search(rf"self\.{n}\b", source) or not source]
    if stray:
        raise UnrecognisedModelError(
            f"{type(hf_model).__name__}: tensors {stray[:5]} belong to no part found (token embedding, decoder "
            f"layers, rotary, position embedding, dropout, final norm, LM head); {HAND_WRITTEN}"
        )
