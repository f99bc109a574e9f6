"""HFCausalLM on tiny random models: HF's causal-LM loss and its token weights, HF's initialisation per layer (the
same built whole or on meta and materialised as HolmesStrategy does), a pretrained directory read layer by layer
into a meta-built model, and the export to a directory `from_pretrained` loads.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from test_hf_layers import TINY_CONFIGS, VOCAB
from torch import nn
from torch.utils.data import DataLoader

from holmes_lightning.hf import HFCausalLM
from holmes_lightning.hf.checkpoint import WEIGHTS, WEIGHTS_INDEX
from holmes_lightning.runtime.materialize import materialize, meta_twins

SEED = 7


def fresh_model(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(TINY_CONFIGS[family]()).eval()


def materialize_all(lm: HFCausalLM, seed: int = SEED) -> None:
    """What HolmesStrategy does on a rank that owns every layer: allocate, then fill each from its own twin; then
    give a tied weight its first holder's values (the sync the runtime owes tied weights)."""
    layers = lm.pipeline_layers()
    twins = meta_twins(layers, range(len(layers)))
    materialize(lm, layers=layers, twins=twins, device=torch.device("cpu"), seed=seed)
    if lm.hf_model.config.tie_word_embeddings:
        with torch.no_grad():
            layers[-1].lm_head.weight.copy_(layers[0].tokens.weight)


def token_batch(size: int = 3, length: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@st.composite
def labelled_batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Random token ids; each label -100 with a random probability (sometimes all of them)."""
    size, length = draw(st.integers(1, 4)), draw(st.integers(1, 10))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    input_ids = torch.randint(3, VOCAB, (size, length), generator=generator)
    ignored = torch.rand(size, length, generator=generator) < draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(ignored, -100)}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@settings(max_examples=15, deadline=None)
@given(batch=labelled_batches())
def test_pipeline_loss_is_hfs_loss(family: str, batch: dict[str, torch.Tensor]) -> None:
    lm = HFCausalLM(fresh_model(family))
    with torch.no_grad():
        hf_loss = lm.hf_model(**batch).loss
        loss = lm.pipeline_loss(lm(batch["input_ids"]), batch["labels"])
    counted = int((batch["labels"][:, 1:] != -100).sum())
    assert lm.pipeline_loss_weight(batch["labels"]) == counted
    if counted:
        torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=0)
    else:  # HF's mean over no token is NaN; this loss is 0
        assert hf_loss.isnan() and loss == 0


def test_no_counted_token_gives_a_zero_loss_and_finite_gradients() -> None:
    lm = HFCausalLM(fresh_model("llama"))
    input_ids = torch.randint(3, VOCAB, (2, 5))
    labels = torch.full_like(input_ids, -100)
    labels[:, 0] = input_ids[:, 0]  # the first label is never predicted: still nothing counted
    loss = lm.pipeline_loss(lm(input_ids), labels)
    loss.backward()
    assert loss.item() == 0 and lm.pipeline_loss_weight(labels) == 0
    assert all(p.grad is not None and p.grad.isfinite().all() for p in lm.parameters())


@settings(max_examples=15, deadline=None)
@given(batch=labelled_batches(), cuts=st.lists(st.integers(1, 3), max_size=3, unique=True))
def test_micro_batch_losses_weighted_by_their_tokens_make_the_batch_loss(
    batch: dict[str, torch.Tensor], cuts: list[int]
) -> None:
    lm = HFCausalLM(fresh_model("qwen2"))
    size = batch["input_ids"].size(0)
    bounds = [0, *sorted(c for c in cuts if c < size), size]
    with torch.no_grad():
        whole = lm.pipeline_loss(lm(batch["input_ids"]), batch["labels"])
        parts = [
            (lm.pipeline_loss(lm(batch["input_ids"][a:b]), labels), lm.pipeline_loss_weight(labels))
            for a, b in zip(bounds, bounds[1:], strict=False)
            for labels in [batch["labels"][a:b]]
        ]
    total = sum(weight for _, weight in parts)
    recombined = sum(loss * weight for loss, weight in parts) / max(int(total), 1)
    torch.testing.assert_close(recombined, whole, rtol=1e-5, atol=1e-7)


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: dict, *_args: object) -> None:
        self.losses.append(outputs["loss"].detach())


def test_training_step_is_hfs_loss_and_a_trainer_fits() -> None:
    model = fresh_model("qwen2").train()
    lm = HFCausalLM(model, learning_rate=1e-2)
    assert lm.hf_model is model and {id(p) for p in lm.parameters()} == {id(p) for p in model.parameters()}
    batch = token_batch()
    expected = model(**batch).loss.detach()
    before = [p.detach().clone() for p in model.parameters()]
    loader = DataLoader([{k: v[i] for k, v in batch.items()} for i in range(3)], batch_size=3)
    recorder = LossRecorder()
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lm, loader, loader)
    torch.testing.assert_close(recorder.losses[0], expected, rtol=1e-5, atol=0)
    assert trainer.callback_metrics["val_loss"] < recorder.losses[-1] < expected
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # all trained


def test_building_on_meta_allocates_nothing() -> None:
    with torch.device("meta"):
        lm = HFCausalLM(TINY_CONFIGS["llama"]())
    assert len(lm.pipeline_layers()) == lm.hf_model.config.num_hidden_layers + 2
    tensors = [*lm.parameters(), *lm.buffers(), *lm.hf_model.parameters(), *lm.hf_model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3"])
def test_random_init_is_hfs_and_the_same_built_whole_or_on_meta(family: str) -> None:
    torch.manual_seed(SEED)
    whole = HFCausalLM(TINY_CONFIGS[family]())
    with torch.device("meta"):
        lm = HFCausalLM(TINY_CONFIGS[family]())
    materialize_all(lm)
    for (name, expected), actual in zip(whole.state_dict().items(), lm.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name
    reference = dict(fresh_model(family, seed=1).named_parameters())  # HF's own initialisation
    for name, parameter in whole.hf_model.named_parameters():
        if reference[name].std() == 0:  # norms, biases
            assert torch.equal(parameter, reference[name]), name
        else:
            assert 0.8 < parameter.std() / reference[name].std() < 1.25, name
    for (name, buffer), expected in zip(lm.hf_model.named_buffers(), fresh_model(family).buffers(), strict=True):
        assert torch.equal(buffer, expected), name  # rotary frequencies, embedding scales


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma3"])
def test_a_pretrained_directory_fills_a_meta_model_layer_by_layer(tmp_path, family: str, sharded: bool) -> None:
    model = fresh_model(family)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / (WEIGHTS_INDEX if sharded else WEIGHTS)).is_file()
    with torch.device("meta"):
        lm = HFCausalLM(tmp_path)
    materialize_all(lm)
    batch = token_batch()
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        for built in (lm, HFCausalLM(tmp_path)):  # on meta and filled per layer; on the CPU
            logits = built.eval()(batch["input_ids"], batch["attention_mask"])
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    for layer in lm.pipeline_layers():
        assert set(lm.pretrained.read(layer.hf_keys)) == set(layer.state_dict())  # only that layer's tensors


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma2"])
def test_the_export_is_a_directory_from_pretrained_loads(tmp_path, family: str) -> None:
    trained = HFCausalLM(fresh_model(family))
    with torch.device("meta"):  # as on a rank that holds no layer: the tensors come gathered
        lm = HFCausalLM(TINY_CONFIGS[family]())
    lm.save_pretrained(tmp_path / "export", [layer.state_dict() for layer in trained.pipeline_layers()])
    trained.hf_model.save_pretrained(tmp_path / "hf")
    exported = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert exported == ["config.json", "generation_config.json", WEIGHTS]
    with safe_open(tmp_path / "export" / WEIGHTS, "pt") as ours, safe_open(tmp_path / "hf" / WEIGHTS, "pt") as hfs:
        assert sorted(ours.keys()) == sorted(hfs.keys())  # tied weights written once, as HF does
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == [type(trained.hf_model).__name__] and config["dtype"] == "float32"
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    batch = token_batch()
    with torch.no_grad():
        expected = trained(batch["input_ids"], batch["attention_mask"])
        actual = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    tied = loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert tied == trained.hf_model.config.tie_word_embeddings


def test_a_lora_adapter_on_meta_starts_from_a_pretrained_directory_as_peft_makes_it(tmp_path) -> None:
    """`HFCausalLM(directory, peft_config=...)` on meta, each layer filled as a rank fills its stage, equals it built
    whole, and equals peft's own `get_peft_model(from_pretrained(directory))` but for LoRA's random A matrices: B at
    zero, DoRA's magnitudes the loaded weights' norms, the `modules_to_save` copy the loaded head; so it starts at
    the pretrained model's logits (HF's `_init_weights` made B random, the magnitudes and the copy anything)."""
    from peft import LoraConfig, get_peft_model

    model = fresh_model("qwen2")  # untied head: its trained copy has an original of its own
    model.save_pretrained(tmp_path)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"])
    with torch.device("meta"):
        lm = HFCausalLM(tmp_path, peft_config=lora)
    materialize_all(lm)
    torch.manual_seed(SEED)
    whole = HFCausalLM(tmp_path, peft_config=lora)
    for (name, expected), actual in zip(whole.state_dict().items(), lm.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name
    peft_own = dict(get_peft_model(tf.AutoModelForCausalLM.from_pretrained(tmp_path), lora).named_parameters())
    built = dict(lm.hf_model.named_parameters())
    assert {n: p.requires_grad for n, p in built.items()} == {n: p.requires_grad for n, p in peft_own.items()}
    for name, parameter in built.items():
        if "lora_A" not in name:
            assert torch.equal(parameter, peft_own[name]), name
    batch = token_batch()
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        torch.testing.assert_close(lm.eval()(batch["input_ids"], batch["attention_mask"]), expected)


def test_a_lora_fine_tune_fits_with_a_logger_writing_its_hyperparameters(tmp_path) -> None:
    """Lightning's loggers write the hyperparameters as YAML, which a peft config is not: it is left out of them, as
    the source is (it failed as the fit started)."""
    from peft import LoraConfig

    lm = HFCausalLM(TINY_CONFIGS["llama"](), peft_config=LoraConfig(r=2), learning_rate=1e-2)
    batch = token_batch()
    loader = DataLoader([{k: v[i] for k, v in batch.items()} for i in range(3)], batch_size=3)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lm, loader)
    (hparams,) = tmp_path.glob("**/hparams.yaml")
    assert "learning_rate: 0.01" in hparams.read_text() and "peft" not in hparams.read_text()


def test_a_peft_model_built_on_meta_gets_its_lora_adapter_as_with_peft_config_and_other_adapters_are_refused() -> None:
    from peft import IA3Config, LoraConfig, get_peft_model

    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(SEED)
    whole = HFCausalLM(TINY_CONFIGS["llama"](), peft_config=lora)
    with torch.device("meta"):
        lm = HFCausalLM(get_peft_model(tf.AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]()), lora))
    materialize_all(lm)
    for (name, expected), actual in zip(whole.state_dict().items(), lm.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name
    adapters = [p for name, p in lm.named_parameters() if "lora_B" in name]
    assert adapters and all(not p.any() for p in adapters)
    with pytest.raises(ValueError, match="and only LoRA adapters with them, not IA3Config"):
        HFCausalLM(TINY_CONFIGS["llama"](), peft_config=IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    with pytest.raises(ValueError, match="already has an adapter"):
        HFCausalLM(whole.hf_model, peft_config=lora)
