import math
import re
from types import SimpleNamespace

import lightning as L
import lightning.pytorch.callbacks.throughput_monitor as throughput_module
import pytest
import torch
import torch.nn.functional as F
from distributed import quiet_trainer
from hydra import compose, initialize_config_dir
from lightning.pytorch.trainer.states import RunningStage
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from holmes_lightning.cli.config import ConfigError, DataConfig, ModelConfig, TrainerConfig, register_configs
from holmes_lightning.recipes import GPT, ByteCorpusDataModule, stdlib_corpus, throughput_monitor
from holmes_lightning.recipes.data import TokenWindows, stdlib_sources
from holmes_lightning.topology import config_dir

register_configs()


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16, **overrides})


def test_pipeline_layers_are_embedding_blocks_head_and_compose_to_forward():
    model = tiny_gpt(n_layers=3)
    layers = model.pipeline_layers()
    assert len(layers) == 3 + 2
    assert layers[0] is model.embedding and layers[-1] is model.head
    assert layers[1:-1] == list(model.blocks)
    idx = torch.randint(0, 256, (2, 16))
    x = idx
    for layer in layers:
        x = layer(x)
    assert x.shape == (2, 16, 256)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)


def test_embedding_and_head_share_no_parameters():
    model = tiny_gpt()
    embedding = {id(p) for p in model.embedding.parameters()}
    assert not embedding & {id(p) for p in model.head.parameters()}
    every_layer = sum(len(list(layer.parameters())) for layer in model.pipeline_layers())
    assert every_layer == len(list(model.parameters()))  # nothing trainable lives outside the pipeline layers


def test_pipeline_loss_is_mean_cross_entropy():
    model = tiny_gpt()
    logits = torch.randn(3, 16, 256)
    targets = torch.randint(0, 256, (3, 16))
    per_token = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1), reduction="none")
    torch.testing.assert_close(model.pipeline_loss(logits, targets), per_token.mean())


def test_attention_is_causal():
    model = tiny_gpt().eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_analytic_flops_bracket_flop_counter():
    """FlopCounterMode counts the matrix multiplies exactly; attention scores are counted only where it knows the op."""
    model = tiny_gpt()
    batch, seq = 2, model.hparams.seq_len
    idx = torch.randint(0, 256, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model.pipeline_loss(model(idx), idx).backward()
    analytic = model.flops_per_token * batch * seq
    attention_scores = 12 * model.hparams.n_layers * model.hparams.d_model * seq * batch * seq
    assert analytic - attention_scores <= counter.get_total_flops() <= analytic


def test_stdlib_corpus_is_deterministic_and_sized():
    first = stdlib_corpus(100_000)
    assert len(first) == 100_000
    assert first == stdlib_corpus(100_000)
    assert first.startswith(stdlib_sources()[0].read_bytes())
    assert not any("site-packages" in p.parts for p in stdlib_sources())


def test_corpus_larger_than_stdlib_is_a_clear_error():
    with pytest.raises(ValueError, match="data.corpus_bytes"):
        stdlib_corpus(10**12)


def test_byte_windows_shift_targets_by_one():
    data = torch.arange(50, dtype=torch.uint8)
    windows = TokenWindows(data, seq_len=8)
    assert len(windows) == 6
    inputs, targets = windows[2]
    assert inputs.dtype == torch.long
    assert inputs.tolist() == list(range(16, 24))
    assert targets.tolist() == list(range(17, 25))


def test_datamodule_split_and_batches_are_deterministic():
    def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
        module = ByteCorpusDataModule(seq_len=32, global_batch=4, corpus_bytes=64_000, val_fraction=0.1, seed=7)
        module.setup("fit")
        assert len(module.train_set) == int(64_000 * 0.9 - 1) // 32
        assert len(module.val_set) == (6_400 - 1) // 32
        return next(iter(module.train_dataloader()))

    inputs, targets = first_batch()
    assert inputs.shape == targets.shape == (4, 32)
    assert int(inputs.max()) < 256
    again = first_batch()
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])


def test_validation_split_smaller_than_a_batch_is_refused():
    module = ByteCorpusDataModule(seq_len=128, global_batch=16, corpus_bytes=20_000, val_fraction=0.05)
    module.setup("fit")
    with pytest.raises(ValueError, match="data.val_fraction"):
        module.val_dataloader()


def test_short_fit_lowers_loss_and_ends_the_cosine_schedule():
    L.seed_everything(0)
    model = tiny_gpt(learning_rate=1e-2, warmup_steps=2, min_lr_ratio=0.1)
    data = ByteCorpusDataModule(seq_len=16, global_batch=8, corpus_bytes=50_000)
    trainer = quiet_trainer(max_steps=12, val_check_interval=12, limit_val_batches=2, num_sanity_val_steps=0)
    initial = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    trainer.fit(model, data)
    assert trainer.callback_metrics["val_loss"] < initial - 0.5
    assert math.isclose(
        trainer.callback_metrics["val_ppl"], math.exp(trainer.callback_metrics["val_loss"]), rel_tol=1e-4
    )
    assert math.isclose(trainer.optimizers[0].param_groups[0]["lr"], 1e-3, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ModelConfig(d_model=130, n_heads=4), "model.d_model=130"),
        (lambda: ModelConfig(vocab_size=100), "model.vocab_size=100"),
        (lambda: DataConfig(val_fraction=1.5), "data.val_fraction=1.5"),
        (lambda: TrainerConfig(precision="bf16"), "trainer.precision='bf16'"),
        (lambda: TrainerConfig(max_steps=3, warmup_steps=5), "trainer.warmup_steps=5"),
    ],
)
def test_config_values_that_cannot_work_name_the_field(make, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        make()


def test_shipped_model_and_trainer_configs_validate():
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        for model in ("gpt_tiny", "gpt_small", "gpt_7_5b"):
            config = OmegaConf.to_object(compose("config", overrides=[f"model={model}"]))
            assert config.model.name == model
            assert config.trainer.max_steps > config.trainer.warmup_steps


class StepClock(L.Callback):
    """The monitors' clock, moved by events instead of wall time: each step takes 1 s, and after step `pause_after`
    a checkpoint save takes `pause_s` more, counted as `HolmesCheckpoint` counts its saves."""

    def __init__(self, pause_after: int, pause_s: float) -> None:
        self.now, self.pause_after, self.pause_s, self.saving_s = 0.0, pause_after, pause_s, 0.0

    def __call__(self) -> float:
        return self.now

    def on_train_batch_start(self, *_args: object) -> None:
        self.now += 1.0

    def on_train_batch_end(self, trainer: L.Trainer, *_args: object) -> None:
        if trainer.global_step == self.pause_after:
            self.now += self.pause_s  # the save runs after both monitors' step end
            self.saving_s += self.pause_s


def test_the_throughput_monitor_leaves_out_paused_seconds_as_it_leaves_out_validation(monkeypatch):
    model, clock = tiny_gpt(), StepClock(pause_after=3, pause_s=7.0)
    monkeypatch.setattr(throughput_module, "time", SimpleNamespace(perf_counter=clock))  # its clock alone
    counted = throughput_monitor(model, 8, 1, window=4, flops_per_sample=model.flops_per_token * 16)
    paused = throughput_monitor(model, 8, 1, window=4, paused_s=lambda: clock.saving_s)
    trainer = quiet_trainer(max_steps=6, limit_val_batches=0, callbacks=[counted, paused, clock])
    trainer.fit(model, ByteCorpusDataModule(seq_len=16, global_batch=8, corpus_bytes=50_000))
    counted_s, paused_s = (monitor._throughputs[RunningStage.TRAINING]._time for monitor in (counted, paused))
    assert counted._throughputs[RunningStage.TRAINING]._lengths == [8 * 16 * step for step in range(3, 7)]  # tokens
    assert model.flops_per_batch == model.flops_per_token * 16 * 8
    assert paused_s == [3.0, 4.0, 5.0, 6.0]  # the window's last four steps, one second each: the save left out
    assert counted_s == [3.0, 11.0, 12.0, 13.0]  # the save's 7 s counted from the step after it
