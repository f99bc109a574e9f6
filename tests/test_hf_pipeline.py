"""Hugging Face causal LMs of five families trained as pp=2 x dp=2 across two_cluster_mixed (tests/hf_script.py, started
with `python script.py`; the cases one after another in one launch) match the HF model itself trained by plain
Lightning in one process on the same dict batches: per-step losses (HF's token-weighted loss, rows padded on the right
or the left, labels -100 among them), tied embedding copies bitwise equal after the steps, the directory `save_hf`
writes loading in `from_pretrained` to the one-process model's logits, and a pretrained directory giving HF's own
first loss.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import hf_script
import lightning as L
import pytest
import torch
import transformers as tf
from torch.utils.data import DataLoader

from holmes_lightning.hf import HFCausalLM
from holmes_lightning.planner import Schedule

SCRIPT = str(Path(hf_script.__file__).resolve())
CASES = [
    ("gpt2", "GPipe", "right"),
    ("llama", "InterleavedZeroBubble", "left"),
    ("qwen2", "GPipe", "left"),
    ("gemma", "1F1B", "right"),
    ("llama", "ZBVZeroBubble", "right"),  # V placement: the tied embedding and head both on the first stage
    ("gptj", "1F1B", "left"),  # position ids cross the stages: torch's shape inference runs stage 1 on them
    ("bloom", "1F1B", "left"),  # every stage builds ALiBi biases from the padding mask it is passed
]
PRETRAINED = ("llama", "GPipe", "right")  # the same launch, built from a saved directory: each rank loads its stage
LORA = ("llama+lora", "ZBVZeroBubble", "right")  # from the directory too: frozen weights, a trained copy of the head
ENV_SECONDS = {"HOLMES_CALIBRATION_SECONDS": "0.05", "OMP_NUM_THREADS": "1"}


class HFItself(HFCausalLM):
    """The reference: the HF model's own forward and loss (`model(**batch).loss`) on each whole global batch."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.hf_model(**batch).loss


def run_script(*args: str, cwd: str) -> None:
    env = {**os.environ, **ENV_SECONDS}
    argv = [sys.executable, SCRIPT, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=cwd, env=env, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]


def rank_results(out: str | Path) -> list[dict]:
    return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(4)]


@pytest.fixture(scope="module")
def every_case(tmp_path_factory) -> Path:
    """All of `CASES`, then `PRETRAINED` and `LORA` from a directory saved here, trained one after another by one
    launch of the script (its ranks start once)."""
    out = tmp_path_factory.mktemp("hf_cases")
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(hf_script.CONFIGS[PRETRAINED[0]]()).save_pretrained(out / "pretrained")
    cases = [",".join(case) for case in CASES]
    cases += [",".join((*case, str(out / "pretrained"))) for case in (PRETRAINED, LORA)]
    run_script("--cases", str(out), *cases, cwd=str(out))
    return out


def reference(family: str, padding: str, source: object = None) -> tuple[list[float], HFItself]:
    """Per-step losses of one process on the global batches in the pipeline's order (each replica's sampler, shuffle
    off, takes rows d, d + 2, ...: together the next 8 rows), and the trained model."""
    L.seed_everything(hf_script.SEED)
    source = source or hf_script.config(family)
    model = HFItself(source, peft_config=hf_script.adapter(family), learning_rate=3e-3)
    losses = hf_script.StepLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=hf_script.STEPS,
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(hf_script.PaddedTokens(padding), batch_size=hf_script.GLOBAL_BATCH, shuffle=False)
    trainer.fit(model, loader)
    return losses.losses, model


@pytest.mark.slow
@pytest.mark.parametrize(("family", "schedule", "padding"), CASES)
def test_an_hf_model_trains_across_the_clusters_as_in_one_process(family, schedule, padding, every_case):
    out = Path(hf_script.case_dir(str(every_case), family, schedule, padding))
    ranks = rank_results(out)
    expected, trained = reference(family, padding)
    assert all(len(plan) == 2 for plan in (rank["plan"] for rank in ranks))
    for rank in ranks:
        assert rank["losses"] == pytest.approx(expected, rel=1e-4), rank
    copies = [rank["tied"] for rank in ranks if rank["tied"] is not None]
    if trained.hf_model.config.tie_word_embeddings:  # bitwise, on the ranks of the stages that hold them
        holders = 2 if Schedule(schedule).v_shaped else 4  # V: the first stage holds both the embedding and head
        assert len(copies) == holders and all(copy == copies[0] for copy in copies)
    saved = tf.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    batch = next(iter(DataLoader(hf_script.PaddedTokens(padding), batch_size=4)))
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        assert torch.allclose(saved(**inputs).logits, trained.hf_model.eval()(**inputs).logits, rtol=1e-4, atol=1e-4)
    written = json.loads((out / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(written) == set(trained.hf_model.state_dict()) - _tied_keys(trained.hf_model)


@pytest.mark.slow
def test_a_lora_adapter_on_a_pretrained_model_trains_as_in_one_process_and_saves_as_peft_does(every_case):
    """Built on meta from a directory, each rank loading its stage's weights and making its stage's adapter, it
    starts at the pretrained model's loss (DoRA's magnitudes from the weights loaded, LoRA's B at zero) and trains
    as in one process; `save_hf` writes the adapter as peft does (before: the peft model's keys as a model's, which
    `from_pretrained` filled at random; then, on the ranks without the LM head, a KeyError for its trained copy)."""
    from peft import PeftModel

    pretrained = every_case / "pretrained"
    out = Path(hf_script.case_dir(str(every_case), *LORA, str(pretrained)))
    expected, trained = reference(LORA[0], LORA[2], source=pretrained)
    batch = next(iter(DataLoader(hf_script.PaddedTokens(LORA[2]), batch_size=hf_script.GLOBAL_BATCH)))
    with torch.no_grad():
        assert expected[0] == pytest.approx(float(tf.AutoModelForCausalLM.from_pretrained(pretrained)(**batch).loss))
    for rank in rank_results(out):
        assert rank["losses"] == pytest.approx(expected, rel=1e-4), rank
    saved = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(pretrained), out / "hf").eval()
    batch = next(iter(DataLoader(hf_script.PaddedTokens(LORA[2]), batch_size=4)))
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        assert torch.allclose(saved(**inputs).logits, trained.hf_model.eval()(**inputs).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_pretrained_directory_loads_stage_by_stage_and_starts_at_hfs_loss(every_case):
    pretrained = every_case / "pretrained"
    ranks = rank_results(hf_script.case_dir(str(every_case), *PRETRAINED, str(pretrained)))
    first = ranks[0]["losses"][0]
    batch = next(iter(DataLoader(hf_script.PaddedTokens(PRETRAINED[2]), batch_size=hf_script.GLOBAL_BATCH)))
    with torch.no_grad():
        hf_loss = tf.AutoModelForCausalLM.from_pretrained(pretrained)(**batch).loss
    assert first == pytest.approx(float(hf_loss), rel=1e-5)


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_hf_llama.py"


@pytest.mark.slow
def test_the_readmes_llama_recipe_trains_and_saves(tmp_path):
    """Under `python` (Lightning's launcher, as the script above launches every case; torchrun: test_user_launches)."""
    env = {**os.environ, **ENV_SECONDS}
    command = [sys.executable, str(RECIPE)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    trained = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "trained-llama")
    rows = (torch.arange(64) + torch.tensor([[5], [99]])) % 256
    with torch.no_grad():
        loss = trained(input_ids=rows, labels=rows).loss
    assert float(loss) < 0.9 * math.log(256)  # it learnt the counting, from a random guess's loss


def _tied_keys(model: torch.nn.Module) -> set[str]:
    """The state-dict keys HF does not save because they repeat a tied weight (the LM head's)."""
    seen, tied = set(), set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(key)
        seen.add(id(tensor))
    return tied
