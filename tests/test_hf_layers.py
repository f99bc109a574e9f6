"""hf_pipeline_layers on tiny random transformers models of each family: applied in order per the calling convention,
the layers give the model's own logits for any padding, with and without the optional batch keys; every parameter
lies in one layer (tied embedding and LM head in two); a model built otherwise gets an error naming what is missing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import cache

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from holmes_lightning.hf import UnrecognisedModelError, hf_pipeline_layers
from holmes_lightning.hf.layers import HFDecoderLayer, HFEmbedding, HFHead

VOCAB = 96
LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    vocab_size=VOCAB,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GEMMA_LIKE = dict(LLAMA_LIKE, head_dim=8, sliding_window=3)
OPT_LIKE = dict(
    hidden_size=32,
    ffn_dim=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    vocab_size=VOCAB,
    word_embed_proj_dim=32,
    max_position_embeddings=32,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Windows shorter than the sequences, scalings far from 1: each family's own operations change the logits.
TINY_CONFIGS: dict[str, Callable[[], tf.PretrainedConfig]] = {
    "gpt2": lambda: tf.GPT2Config(
        n_embd=32, n_layer=3, n_head=4, n_positions=32, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2
    ),
    "llama": lambda: tf.LlamaConfig(**LLAMA_LIKE, tie_word_embeddings=True),
    "llama-eager": lambda: tf.LlamaConfig(**LLAMA_LIKE, attn_implementation="eager"),
    "mistral": lambda: tf.MistralConfig(**LLAMA_LIKE, sliding_window=3),
    "qwen2": lambda: tf.Qwen2Config(**LLAMA_LIKE, tie_word_embeddings=False),
    "qwen3": lambda: tf.Qwen3Config(**LLAMA_LIKE, head_dim=8),
    "phi3": lambda: tf.Phi3Config(**LLAMA_LIKE),
    "gemma": lambda: tf.GemmaConfig(**LLAMA_LIKE, head_dim=8),
    "gemma2": lambda: tf.Gemma2Config(**GEMMA_LIKE, final_logit_softcapping=0.5),
    "gemma3": lambda: tf.Gemma3TextConfig(
        **GEMMA_LIKE, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    ),
    "granite": lambda: tf.GraniteConfig(**LLAMA_LIKE, embedding_multiplier=3.0, logits_scaling=4.0),
    "cohere": lambda: tf.CohereConfig(**LLAMA_LIKE, logit_scale=0.25),
    "olmo": lambda: tf.OlmoConfig(**LLAMA_LIKE, clip_qkv=0.5),  # a final norm without weights
    "olmo2": lambda: tf.Olmo2Config(**LLAMA_LIKE),
    "phi": lambda: tf.PhiConfig(**LLAMA_LIKE, partial_rotary_factor=0.5),
    "starcoder2": lambda: tf.Starcoder2Config(**LLAMA_LIKE, sliding_window=3),
    "mixtral": lambda: tf.MixtralConfig(**LLAMA_LIKE, num_local_experts=4),
    "falcon": lambda: tf.FalconConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2
    ),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**LLAMA_LIKE, rotary_pct=0.5),
    "gptj": lambda: tf.GPTJConfig(  # rotary sin/cos looked up by position id
        n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=32, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2
    ),
    "codegen": lambda: tf.CodeGenConfig(
        n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=32, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2
    ),
    "opt": lambda: tf.OPTConfig(**OPT_LIKE),  # positions looked up at position id + 2
    "opt-350m": lambda: tf.OPTConfig(  # embeddings narrower than the layers, no final norm (norms after each part)
        **dict(OPT_LIKE, word_embed_proj_dim=16), do_layer_norm_before=False
    ),
    "bloom": lambda: tf.BloomConfig(  # ALiBi biases, a norm of the embeddings
        hidden_size=32, n_layer=3, n_head=4, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0
    ),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(  # multi-query attention; an unused causal-mask table is left out
        n_embd=32, n_layer=3, n_head=4, n_positions=32, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2
    ),
    "biogpt": lambda: tf.BioGptConfig(**LLAMA_LIKE, max_position_embeddings=32),
}
TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
POSITIONS_FROM_MASK = {"opt", "opt-350m"}  # HF's OPT counts absent position ids from the attention mask


@cache
def tiny_model(family: str) -> nn.Module:
    """A random tiny `*ForCausalLM` of `family`, in eval mode (no dropout), the same on every call."""
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(TINY_CONFIGS[family]()).eval()


@st.composite
def batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Token ids padded on the right or the left (each row keeps a token), with or without mask and position keys."""
    size, length = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    input_ids = torch.randint(3, VOCAB, (size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    left = draw(st.booleans())
    for row in range(size):
        padding = draw(st.integers(0, length - 1))
        if left:
            attention_mask[row, :padding] = 0
        elif padding:
            attention_mask[row, -padding:] = 0
    batch = {"input_ids": input_ids.masked_fill(attention_mask == 0, 0)}
    if draw(st.booleans()) or not attention_mask.all():
        batch["attention_mask"] = attention_mask
    if draw(st.booleans()):
        batch["position_ids"] = torch.arange(length).expand(size, length)
    return batch


def apply_layers(layers: list[nn.Module], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The runtime's calling convention: absent keys filled with HF's defaults, then `layer(*out)`, only tensors."""
    input_ids = batch["input_ids"]
    attention_mask = batch.get("attention_mask", torch.ones_like(input_ids))
    position_ids = batch.get("position_ids", torch.arange(input_ids.size(1)).expand_as(input_ids))
    out = layers[0](input_ids, attention_mask, position_ids)
    for layer in layers[1:]:
        assert isinstance(out, tuple) and len(out) == 3 and all(torch.is_tensor(t) for t in out)
        out = layer(*out)
    return out


@pytest.mark.parametrize("family", TINY_CONFIGS)
@settings(max_examples=12, deadline=None)
@given(batch=batches())
def test_layers_give_the_models_logits(family: str, batch: dict[str, torch.Tensor]) -> None:
    model = tiny_model(family)
    layers = hf_pipeline_layers(model)
    if family in POSITIONS_FROM_MASK:  # the runtime's absent positions are 0..T-1 for every family
        batch = {"position_ids": torch.arange(batch["input_ids"].size(1)).expand_as(batch["input_ids"]), **batch}
    with torch.no_grad():
        expected = model(**batch).logits
        logits = apply_layers(layers, batch)
    assert logits.shape == (*batch["input_ids"].shape, VOCAB)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_layers_are_embedding_decoder_layers_and_head() -> None:
    model = tiny_model("gemma3")
    layers = hf_pipeline_layers(model)
    assert [type(layer) for layer in layers] == [HFEmbedding, HFDecoderLayer, HFDecoderLayer, HFDecoderLayer, HFHead]
    assert [layer.block for layer in layers[1:-1]] == list(model.model.layers)
    assert [layer.layer_type for layer in layers[1:-1]] == model.config.layer_types
    assert layers[0].tokens is model.model.embed_tokens and layers[-1].lm_head is model.lm_head
    assert layers[-1].softcap == model.config.final_logit_softcapping is None  # Gemma3 text: none by default


def test_packed_sequences_without_a_mask_are_masked_as_hf_does() -> None:
    """Position ids that restart mark packed sequences (HF: when there is no mask and no cache); the all-ones mask the
    runtime fills in must not hide them."""
    model = tiny_model("llama")
    input_ids = torch.randint(3, VOCAB, (2, 9))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    with torch.no_grad():
        expected = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        unpacked = model(input_ids=input_ids).logits
        logits = apply_layers(hf_pipeline_layers(model), {"input_ids": input_ids, "position_ids": position_ids})
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits[0, 4:], unpacked[0, 4:], atol=1e-3)  # the packing changes the logits


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma3", "phi3"])
def test_every_tensor_lies_in_one_layer_but_tied_weights(family: str) -> None:
    model = tiny_model(family)
    layers = hf_pipeline_layers(model)
    owners = Counter(id(p) for layer in layers for p in layer.parameters())
    shared = {id(p) for p in model.parameters() if owners[id(p)] > 1}
    assert set(owners) == {id(p) for p in model.parameters()}
    tied = model.config.tie_word_embeddings
    assert shared == ({id(model.get_input_embeddings().weight)} if tied else set())
    assert all(owners[i] == 2 for i in shared)
    in_layers = {id(b) for layer in layers for b in layer.buffers()}
    assert in_layers == {id(b) for b in model.buffers()}
    assert {key for layer in layers for keys in layer.hf_keys.values() for key in keys} == set(model.state_dict())


def test_qwen2_attention_has_bias_and_an_untied_head() -> None:
    """What the Qwen2 case stands for: qkv biases and a separate LM head."""
    model = tiny_model("qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_layers_train_the_models_parameters() -> None:
    """The gradients of a loss through the layers are those through the model: the parameters are the model's."""
    model = tiny_model("qwen2")
    batch = {"input_ids": torch.randint(3, VOCAB, (2, 7))}
    model.zero_grad()
    model(**batch).logits.square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    apply_layers(hf_pipeline_layers(model), batch).square().mean().backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-5, atol=1e-7)
    model.zero_grad()


@pytest.mark.parametrize(
    ("model", "missing"),
    [
        (nn.Linear(2, 2), "not a transformers PreTrainedModel"),
        (
            tf.NanoChatForCausalLM(tf.NanoChatConfig(**TINY, intermediate_size=32)),
            r"applied more than once \['norm'\]",  # before the decoder layers and after them
        ),
        (tf.CTRLLMHeadModel(tf.CTRLConfig(n_embd=16, dff=32, n_layer=1, n_head=2)), r"tensors \['pos_encoding'\]"),
        (tf.MptForCausalLM(tf.MptConfig(d_model=16, n_layers=1, n_heads=2)), r"needs \['position_bias'\]"),
        (tf.XGLMForCausalLM(tf.XGLMConfig(d_model=16, num_layers=1, attention_heads=2)), "no position_embeddings"),
        (tf.FalconForCausalLM(tf.FalconConfig(**TINY, alibi=True)), "alibi=True"),
        (tf.GPT2Model(tf.GPT2Config(n_embd=16, n_layer=1, n_head=2)), "no LM head"),
    ],
    ids=["not-hf", "nanochat", "ctrl", "mpt", "xglm", "falcon-alibi", "no-head"],
)
def test_an_unrecognised_model_gets_an_error_naming_the_part(model: nn.Module, missing: str) -> None:
    with pytest.raises(UnrecognisedModelError, match=missing) as error:
        hf_pipeline_layers(model)
    assert "write `pipeline_layers()` by hand" in str(error.value)
