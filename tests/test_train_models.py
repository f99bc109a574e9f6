"""train.py end to end beyond the GPT (each a multi-process run): the tiny random Llama of `model=hf_llama` across
two_cluster_mixed, a LoRA adapter on a pretrained HF directory with its tokenizer on a local text file under torchrun,
logged to wandb offline (each model written out as an HF directory at the end), and a user's own LightningModule and
LightningDataModule by `_target_`, with arguments added on the command line.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import torch
import transformers as tf
import yaml
from test_train import DEPRECATION, run_train, summary_of
from test_train_sources import TEXT, pretrained_llama

SUMMARY_WITHOUT_FLOPS = re.compile(
    r"holmes: (\d+) steps, train loss ([\d.]+) -> ([\d.]+) \| ([\d,]+) tokens/s \(predicted [\d,]+: measured / "
    r"predicted [\d.]+\) without validation and checkpoint saves \| peak memory per rank"
)
USER_PACKAGE = '''
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModule(L.LightningModule):
    """Token -> next token (counting up modulo `vocab`), as embedding, hidden layer and head."""

    def __init__(self, width: int, vocab: int = 64):
        super().__init__()
        self.save_hyperparameters()
        hidden = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.layers = nn.Sequential(nn.Embedding(vocab, width), hidden, nn.Linear(width, vocab))

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, outputs, targets):
        return nn.functional.cross_entropy(outputs.flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self.layers(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class MyData(L.LightningDataModule):
    def __init__(self, rows: int, length: int = 16, vocab: int = 64):
        super().__init__()
        self.save_hyperparameters()
        start = torch.randint(vocab, (rows, 1), generator=torch.Generator().manual_seed(0))
        self.tokens = (start + torch.arange(length + 1)) % vocab

    def train_dataloader(self):  # each DP replica's share of the global batch; Lightning's sampler splits the rows
        data = TensorDataset(self.tokens[:, :-1], self.tokens[:, 1:])
        return DataLoader(data, batch_size=self.trainer.strategy.replica_batch_size, shuffle=True, drop_last=True)
'''


@pytest.mark.slow
def test_hf_llama_from_its_config_trains_across_the_two_clusters(tmp_path):
    out = run_train("cluster=two_cluster_mixed", "model=hf_llama", "trainer.max_steps=8", f"output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting 4 ranks" in out.stdout and "HFDecoderLayer" in out.stdout + out.stderr  # planned on its layers
    assert DEPRECATION.findall(out.stdout + out.stderr) == []
    steps, first, last, tokens_per_s, tflops = summary_of(out)
    assert steps == 8 and abs(first - math.log(256)) < 0.2  # HF's initialisation: near-uniform over the bytes
    assert last < first - 0.5 and tokens_per_s > 0 and tflops > 0
    (export,) = tmp_path.glob("*/hf")  # the trained model, as an HF directory: it learnt the bytes of source code
    assert f"the trained model written as an HF directory: {export}" in out.stdout
    rows = torch.tensor(list(Path(os.__file__).read_bytes()[:256])).view(2, 128)
    with torch.no_grad():
        assert float(tf.AutoModelForCausalLM.from_pretrained(export)(input_ids=rows, labels=rows).loss) < first - 0.3


@pytest.mark.slow
def test_under_torchrun_a_lora_adapter_trains_on_a_pretrained_directory_and_logs_to_wandb_offline(tmp_path):
    """torchrun starts the 2 ranks (the script launches none, and makes one run directory for the job, not one per
    rank). The directory's LM head is scaled up, so its first loss is far above a random model's: the weights were
    read. A LoRA adapter (peft's default modules: query and value) trains on them and its tokenizer's tokens of a
    text file, and is written as peft writes one. Its checkpoints hold the adapter, not the base it reads at start."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel

    vocabulary = pretrained_llama(tmp_path / "llama", head_scale=100.0)
    (tmp_path / "corpus.txt").write_text(TEXT * 100)
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py")
    out = run_train(
        "cluster=single_node",
        "logger=wandb",
        "model=hf_llama",
        f"model.pretrained={tmp_path / 'llama'}",
        "model.lora.r=4",
        f"data.text_file={tmp_path / 'corpus.txt'}",
        "data.global_batch=8",
        "data.val_fraction=0.2",
        "trainer.max_steps=6",
        "checkpoint.every_n_steps=3",
        f"output_dir={tmp_path / 'runs'}",
        command=torchrun,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting" not in out.stdout  # torchrun started the ranks; the script did not launch its own
    assert DEPRECATION.findall(out.stdout + out.stderr) == []
    steps, first, last, _, _ = summary_of(out)
    assert steps == 6 and first > 2 * math.log(vocabulary) and last < first
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "checkpoints"]
    assert run_dir.name.startswith("torchrun-") and list(run_dir.glob("wandb/offline-run-*"))
    tuned = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "llama"), run_dir / "hf")
    adapters = {name: p for name, p in tuned.named_parameters() if "lora_B" in name}
    assert len(adapters) == 2 * 2 and all(p.any() for p in adapters.values())  # q and v of both layers, trained
    saved = dcp.FileSystemReader(tmp_path / "runs/checkpoints/step_000006.ckpt").read_metadata().state_dict_metadata
    weights = [name for name in saved if name.startswith("model.")]
    assert len(weights) == 2 * 2 * 2 and all(".lora_" in name for name in weights)  # A and B of q and v, 2 layers


@pytest.mark.slow
def test_your_own_module_and_datamodule_train_by_target(tmp_path, monkeypatch):
    (tmp_path / "my_package").mkdir()
    (tmp_path / "my_package" / "__init__.py").write_text(USER_PACKAGE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = run_train(
        "cluster=single_node",
        "model._target_=my_package.MyModule",
        "+model.width=32",
        "data._target_=my_package.MyData",
        "+data.rows=512",
        "trainer.max_steps=8",
        f"output_dir={tmp_path / 'runs'}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "train.py: my_package.MyModule is profiled and planned once the ranks have built it" in out.stdout
    match = SUMMARY_WITHOUT_FLOPS.search(out.stdout)
    assert match, out.stdout[-3000:]
    steps, first, last = int(match[1]), float(match[2]), float(match[3])
    assert steps == 8 and abs(first - math.log(64)) < 0.5 and last < first - 0.3
    (hparams,) = (tmp_path / "runs").glob("*/csv/hparams.yaml")
    assert yaml.safe_load(hparams.read_text()) == {"width": 32, "vocab": 64, "rows": 512, "length": 16}
