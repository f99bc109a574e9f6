"""Checkpoint files on one process: what a save publishes, which directory `latest` picks, what `check` rejects.

torch.distributed.checkpoint saves and loads in a single process without a process group, so these run the real
save/load code; the multi-process cases (crash mid-save, resume on pp=2 x dp=2) are in test_resume.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from torch import nn

from holmes_lightning import planner
from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.planner import BatchSettings, ModelProfile, Plan
from holmes_lightning.runtime import checkpoint, frozen
from holmes_lightning.runtime.checkpoint import CheckpointError
from holmes_lightning.runtime.preemption import HolmesCheckpoint
from holmes_lightning.topology import Topology

SHAPE = {"n_layers": 2, "d_model": 16}


def one_rank_plan(n_layers: int = 2) -> Plan:
    model = ModelConfig(n_layers=n_layers, d_model=16, n_heads=2, seq_len=8)
    return planner.best_plan(
        Topology.from_config("single_node", devices_per_node=1), ModelProfile.from_gpt(model), BatchSettings(4)
    )


def trained(width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    module = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return module, optimizer


def save(directory: Path, step: int, model: tuple[nn.Module, torch.optim.Optimizer] | None = None) -> Path:
    module, optimizer = model or trained()
    state = {
        "state_dict": checkpoint.model_state(module),
        "optimizer_states": [checkpoint.optimizer_state(module, optimizer)],
        "global_step": step,
        "epoch": 0,
        "hyper_parameters": SHAPE,
        "pytorch-lightning_version": L.__version__,
    }
    path = directory / f"step_{step:06d}.ckpt"
    checkpoint.save(state, path, plan=one_rank_plan(), rank=0)
    return path


def test_a_save_publishes_one_complete_directory(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003.ckpt"]  # the staging directory became it
    names = {p.name for p in path.iterdir()}
    assert {".metadata", "meta.pt", "plan.json", "complete.json", "rng_rank0.pt"} <= names
    assert any(name.endswith(".distcp") for name in names)
    manifest = json.loads((path / "complete.json").read_text())
    assert {k: manifest[k] for k in ("global_step", "epoch", "world_size")} == {
        "global_step": 3,
        "epoch": 0,
        "world_size": 1,
    }
    assert sorted(manifest["sha256"]) == sorted(names - {"complete.json"})  # every other file, with its digest
    assert manifest["sha256"]["plan.json"] == hashlib.sha256((path / "plan.json").read_bytes()).hexdigest()
    assert checkpoint.check(path, one_rank_plan(), SHAPE) == path


def test_load_restores_weights_optimizer_and_random_state(tmp_path: Path) -> None:
    module, optimizer = trained()
    random.seed(7)
    expected_draw = random.random()
    random.seed(7)
    path = save(tmp_path, 1, (module, optimizer))
    fresh, fresh_optimizer = trained()
    meta, rng = checkpoint.load(path, fresh, [fresh_optimizer], plan=one_rank_plan(), rank=0, strict=True)
    assert meta["global_step"] == 1
    for mine, theirs in zip(module.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert (
        checkpoint.optimizer_state(fresh, fresh_optimizer).keys()
        == checkpoint.optimizer_state(module, optimizer).keys()
    )
    random.seed(0)
    random.setstate(rng["python"])
    assert random.random() == expected_draw


def test_a_param_group_setting_added_since_the_save_keeps_its_value(tmp_path: Path) -> None:
    """Lightning's LR finder saves, adds a scheduler (which sets `initial_lr` in every param group), then loads."""
    module, optimizer = trained()
    path = save(tmp_path, 1, (module, optimizer))
    optimizer.param_groups[0]["lr"] = 0.5
    torch.optim.lr_scheduler.LinearLR(optimizer)
    checkpoint.load(path, module, [optimizer], plan=one_rank_plan(), rank=0, strict=True)
    assert optimizer.param_groups[0]["lr"] == 0.1  # the saved setting
    assert optimizer.param_groups[0]["initial_lr"] == 0.5  # the one the checkpoint lacks


def fine_tuned(base_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`trained()`'s network with its first layer frozen at weights drawn from `base_seed` (a pretrained base)."""
    torch.manual_seed(base_seed)
    base = nn.Linear(4, 16).requires_grad_(False)
    torch.manual_seed(0)
    module = nn.Sequential(base, nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(module[2].parameters(), lr=0.1)
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return module, optimizer


def test_a_checkpoint_without_the_frozen_weights_resumes_on_the_same_ones_only(tmp_path: Path) -> None:
    module, optimizer = fine_tuned(base_seed=1)
    trained, left_out = frozen.split(checkpoint.model_state(module), module)
    state = {"state_dict": trained, "optimizer_states": [checkpoint.optimizer_state(module, optimizer)]}
    path = tmp_path / "step_000001.ckpt"
    checkpoint.save(state, path, plan=one_rank_plan(), rank=0, left_out=left_out)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert sorted(k for k in saved if k.startswith("model.")) == ["model.2.bias", "model.2.weight"]

    same_base, same_optimizer = fine_tuned(base_seed=1)
    same_base[2].reset_parameters()
    meta, _ = checkpoint.load(path, same_base, [same_optimizer], plan=one_rank_plan(), rank=0, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), same_base.parameters(), strict=True))
    assert frozen.FINGERPRINT_KEY not in meta  # Lightning gets its own part only

    other_base, other_optimizer = fine_tuned(base_seed=2)
    with pytest.raises(CheckpointError, match=r"holds no frozen weights.*2 differ, e.g. '0.bias'.*same pretrained"):
        checkpoint.load(path, other_base, [other_optimizer], plan=one_rank_plan(), rank=0, strict=True)


class Classifier(L.LightningModule):
    """`trained()`'s network as a LightningModule, as a user's script defines it."""

    def __init__(self, n_layers: int, d_model: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, d_model), nn.Tanh(), nn.Linear(d_model, 2))


def test_lightnings_consolidation_makes_one_file_that_load_from_checkpoint_reads(tmp_path: Path) -> None:
    """`python -m lightning.pytorch.utilities.consolidate_checkpoint` reads Lightning's sharded layout; it refused
    ours (KeyError: 'model'), so a model trained under HolmesStrategy could not leave it."""
    module = Classifier(**SHAPE)
    module.net = trained()[0]
    optimizer = torch.optim.AdamW(module.parameters())
    path = save(tmp_path, 5, (module, optimizer))
    out = tmp_path / "one_file.ckpt"
    command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(path)]
    subprocess.run([*command, "--output_file", str(out)], check=True, capture_output=True)
    loaded = Classifier.load_from_checkpoint(out)
    assert loaded.hparams == SHAPE and torch.load(out, weights_only=False)["global_step"] == 5
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_checkpoint_of_an_earlier_version_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Earlier versions kept the weights under DCP's "state_dict" key."""
    module, optimizer = trained()
    with monkeypatch.context() as earlier:
        earlier.setattr(checkpoint, "MODEL_KEY", checkpoint.LEGACY_MODEL_KEY)
        path = save(tmp_path, 2, (module, optimizer))
    fresh, fresh_optimizer = trained()
    checkpoint.load(path, fresh, [fresh_optimizer], plan=one_rank_plan(), rank=0, strict=True)
    for mine, theirs in zip(module.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_loading_into_another_shape_names_the_tensor(tmp_path: Path) -> None:
    path = save(tmp_path, 1)
    other, other_optimizer = trained(width=8)
    with pytest.raises(
        CheckpointError,
        match=r"does not fit this model \(Size mismatch between saved torch.Size\(\[16, 4\]\) and current: .*\[8, 4\]",
    ):
        checkpoint.load(path, other, [other_optimizer], plan=one_rank_plan(), rank=0, strict=True)


def test_latest_is_the_highest_complete_step(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    for step in (2, 10, 4):
        save(tmp_path, step)
    (tmp_path / ".step_000012.ckpt.partial").mkdir()  # a save that crashed
    copied = tmp_path / "step_000011.ckpt"  # a copy that did not finish: no marker
    copied.mkdir()
    (copied / "plan.json").write_text("{}")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000010.ckpt"


def test_a_save_clears_what_a_crashed_save_left(tmp_path: Path) -> None:
    (tmp_path / ".step_000006.ckpt.partial").mkdir()
    save(tmp_path, 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000009.ckpt"]


def test_remove_unpublishes_before_deleting(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    checkpoint.remove(path)
    assert list(tmp_path.iterdir()) == []


def _truncate_shard(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    file.write_bytes(bytes(data))


CORRUPTIONS = {
    "no marker": (lambda p: (p / "complete.json").unlink(), r"is incomplete \(no complete.json"),
    "truncated shard": (_truncate_shard, r"is corrupt: shard __0_0.distcp has 10 of its \d+ bytes"),
    "missing shard": (lambda p: next(p.glob("*.distcp")).unlink(), r"is corrupt: shard __0_0.distcp is missing"),
    "garbage metadata": (lambda p: (p / ".metadata").write_bytes(b"junk"), r"is corrupt: \.metadata is unreadable"),
    "garbage meta.pt": (lambda p: (p / "meta.pt").write_bytes(b"junk"), r"is corrupt: meta\.pt is unreadable"),
    "garbage plan": (lambda p: (p / "plan.json").write_text("{"), r"is corrupt: plan\.json is unreadable"),
    "flipped byte in a shard": (
        lambda p: _flip_a_byte(next(p.glob("*.distcp"))),
        r"is corrupt: __0_0.distcp changed since the save \(its sha256 differs from the one in complete.json",
    ),
    "flipped byte in the random state": (
        lambda p: _flip_a_byte(p / "rng_rank0.pt"),
        r"is corrupt: rng_rank0.pt changed since the save",
    ),
    "random state gone": (
        lambda p: (p / "rng_rank0.pt").unlink(),
        r"is corrupt: rng_rank0.pt changed .* or it is gone",
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_damaged_checkpoint_is_refused_and_another_offered(tmp_path: Path, corruption: str) -> None:
    damage, message = CORRUPTIONS[corruption]
    save(tmp_path, 3)
    path = save(tmp_path, 6)
    damage(path)
    with pytest.raises(CheckpointError, match=message) as error:
        checkpoint.check(path, one_rank_plan(), SHAPE)
    assert "resume from another checkpoint" in str(error.value) and "step_000003.ckpt" in str(error.value)


def test_load_refuses_a_shard_that_changed_since_the_save(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    _flip_a_byte(next(path.glob("*.distcp")))
    module, optimizer = trained()
    with pytest.raises(CheckpointError, match=r"is corrupt: __0_0.distcp changed since the save"):
        checkpoint.load(path, module, [optimizer], plan=one_rank_plan(), rank=0, strict=True)
    checkpoint.check(path, one_rank_plan(), SHAPE, checksums=False)  # sizes and metadata alone cannot tell


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    with pytest.raises(CheckpointError, match=r"holds another model \(d_model=16 there, 32 here\)"):
        checkpoint.check(path, one_rank_plan(), {"n_layers": 2, "d_model": 32})
    with pytest.raises(CheckpointError, match="holds a model of 4 pipeline layers, this run has 5"):
        checkpoint.check(path, one_rank_plan(n_layers=3))
    with pytest.raises(CheckpointError, match="no such checkpoint directory; resume from another"):
        checkpoint.check(tmp_path / "step_000004.ckpt")


def test_keeping_no_checkpoint_is_refused() -> None:
    with pytest.raises(ValueError, match=r"HolmesCheckpoint\(keep=0\): keep at least 1"):
        HolmesCheckpoint("unused", keep=0)


def test_a_directory_that_rank_0_cannot_see_written_is_not_shared() -> None:
    problem = checkpoint.sharing_problem("/ckpt", ["a", "a", "b", "b"], seen={0, 1}, listings=[[]] * 4)
    assert problem.startswith("checkpoint directory '/ckpt' is not shared: rank 0 on a does not see the files")
    assert "rank(s) [2, 3] on b wrote into it" in problem and "checkpoint.dir=" in problem


def test_ranks_that_list_different_checkpoints_are_refused() -> None:
    listings = [["step_000003.ckpt", "step_000006.ckpt"], ["step_000003.ckpt"]]
    problem = checkpoint.sharing_problem("/ckpt", ["a", "b"], seen={0, 1}, listings=listings)
    assert "rank 0 on a: step_000003.ckpt, step_000006.ckpt; rank 1 on b: step_000003.ckpt" in problem
    assert checkpoint.sharing_problem("/ckpt", ["a", "b"], seen={0, 1}, listings=[listings[0]] * 2) is None


def shared_directory_verdicts(root: str) -> dict[str, str | None]:
    """Rank side: `check_shared` on one directory for all, then on one directory per rank (as per-node disks)."""
    torch.distributed.init_process_group("gloo")
    verdicts = {}
    for case, directory in (("shared", Path(root)), ("per rank", Path(root, f"rank{os.environ['RANK']}"))):
        try:
            checkpoint.check_shared(directory)
            verdicts[case] = None
        except CheckpointError as error:
            verdicts[case] = str(error)
    torch.distributed.destroy_process_group()
    return verdicts


@pytest.mark.slow
def test_every_rank_refuses_a_checkpoint_directory_that_is_not_shared(tmp_path: Path) -> None:
    verdicts = run_ranks("test_checkpoint:shared_directory_verdicts", cluster="single_node", root=str(tmp_path))
    assert all(v["shared"] is None for v in verdicts)
    assert all("is not shared: rank 0 on" in v["per rank"] and "rank(s) [1]" in v["per rank"] for v in verdicts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]  # the tokens are gone
