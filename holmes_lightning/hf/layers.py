"""The three kinds of pipeline layer a transformers causal LM is cut into: embedding, decoder layer, head.

Each wraps the HF model's own submodules (its parameters are the model's) and passes on only tensors:
the embedding maps `(input_ids, attention_mask, position_ids)` to `(hidden_states, attention_mask, position_ids)`,
each decoder layer maps that triple to the next one, recomputing from the 2-D attention mask and the position ids
what HF's model forward computes once (the 4-D mask with transformers' own mask helpers, the rotary cos/sin), and the
head maps it to logits. `hf_keys` names, for each entry of a layer's `state_dict()`, the HF state-dict keys of that
tensor (more than one where weights are tied, the first being the one HF saves).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

Hidden = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (hidden_states, attention_mask, position_ids)
MASKS: dict[str, Callable[..., torch.Tensor | None]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


class HFEmbedding(nn.Module):
    """Token embedding (-> projection to the hidden width) (+ learned position embedding) (x embedding multiplier)
    (-> norm) (+ dropout), as the HF model applies them.

    A position embedding with an integer `offset` (OPT's) is indexed by position id + offset.
    """

    def __init__(
        self,
        tokens: nn.Module,
        *,
        project_in: nn.Module | None = None,
        positions: nn.Embedding | None = None,
        multiplier: float | None = None,
        norm: nn.Module | None = None,
        dropout: nn.Dropout | None = None,
    ) -> None:
        super().__init__()
        self.tokens = tokens
        self.project_in = project_in  # OPT-350m: embeddings narrower than the hidden states
        self.positions = positions
        self.position_offset = getattr(positions, "offset", 0)
        self.multiplier = multiplier
        self.norm = norm  # BLOOM: a norm of the embeddings
        self.dropout = dropout
        self.hf_keys: dict[str, tuple[str, ...]] = {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> Hidden:
        hidden_states = self.tokens(input_ids)
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        if self.positions is not None:
            hidden_states = hidden_states + nn.Embedding.forward(self.positions, position_ids + self.position_offset)
        if self.multiplier is not None:
            hidden_states = hidden_states * self.multiplier
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if self.dropout is not None:
            hidden_states = self.dropout(hidden_states)
        return hidden_states, attention_mask, position_ids


class HFDecoderLayer(nn.Module):
    """One HF decoder layer, given the 4-D mask of its `layer_type` and, where the family has them, rotary cos/sin or
    ALiBi biases (`alibi(attention_mask, num_heads, dtype)`, its modeling module's `build_alibi_tensor`).

    A 2-D mask of all ones is passed to the mask helper as no mask: the runtime fills an absent mask with ones, and
    HF then also detects packed sequences from position ids that restart. On the meta device (profiling a model too
    big to build: shapes only) no mask is made; attention costs the same.
    """

    def __init__(
        self,
        block: nn.Module,
        config: PretrainedConfig,
        layer_type: str,
        rotary: nn.Module | None,
        rotary_by_type: bool,
        alibi: Callable[[torch.Tensor, int, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config
        self.layer_type = layer_type
        self.rotary_by_type = rotary_by_type  # the rotary module takes the layer type (Gemma3: local and global rope)
        self.alibi = alibi
        self.hf_keys: dict[str, tuple[str, ...]] = {}

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> Hidden:
        mask = None if hidden_states.is_meta else self._mask(hidden_states, attention_mask, position_ids)
        extra = {}
        if self.rotary is not None:
            by_type = (self.layer_type,) if self.rotary_by_type else ()
            extra["position_embeddings"] = self.rotary(hidden_states, position_ids, *by_type)
        if self.alibi is not None:
            extra["alibi"] = self.alibi(attention_mask, self.config.num_attention_heads, hidden_states.dtype)
        out = self.block(hidden_states, attention_mask=mask, position_ids=position_ids, **extra)
        return (out[0] if isinstance(out, tuple) else out), attention_mask, position_ids

    def _mask(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor | None:
        padding = None if bool(attention_mask.all()) else attention_mask
        return MASKS[self.layer_type](
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=padding,
            cache=None,
            position_ids=position_ids,
        )


class HFHead(nn.Module):
    """Final norm (-> projection to the embedding width), LM head, then the family's logit scaling and soft-capping:
    hidden states -> logits (B, T, V)."""

    def __init__(
        self,
        norm: nn.Module | None,
        lm_head: nn.Module,
        *,
        project_out: nn.Module | None = None,
        logit_scale: float | None,
        logits_divisor: float | None,
        softcap: float | None,
    ) -> None:
        super().__init__()
        self.norm = norm  # None: OPT-350m, whose layers normalise after themselves
        self.project_out = project_out
        self.lm_head = lm_head
        self.logit_scale = logit_scale  # Cohere: logits * logit_scale
        self.logits_divisor = logits_divisor  # Granite: logits / logits_scaling
        self.softcap = softcap  # Gemma 2 and 3: softcap * tanh(logits / softcap)
        self.hf_keys: dict[str, tuple[str, ...]] = {}

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        logits = self.lm_head(hidden_states)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
