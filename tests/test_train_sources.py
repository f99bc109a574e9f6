"""train.py's models and data beyond the GPT, in one process: `model=hf_llama` and `_target_` nodes compose (typos
still refused), an HF model is profiled from its config as the planner plans it, the data sources yield the tokens
and batch forms they should, and bad targets, paths and missing packages stop `train.py` with one `error:` line
before any rank starts.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from test_bad_input import assert_clean_error, run_cli
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from holmes_lightning.cli.config import (
    BatchFormat,
    ConfigError,
    DataConfig,
    HFModelConfig,
    TrainConfig,
    error_line,
    register_configs,
)
from holmes_lightning.cli.data import build_data, check_data
from holmes_lightning.cli.models import build_model, check_model
from holmes_lightning.cli.targets import added_keys
from holmes_lightning.hf import HFCausalLM
from holmes_lightning.recipes.data import StdlibBytes, TokenDataModule
from holmes_lightning.recipes.text import SavedDataset, TextFile
from holmes_lightning.topology import config_dir

register_configs()
TEXT = "def f(x):\n    return x + 1  # ünïcode\n" * 40


def composed(*overrides: str) -> tuple[TrainConfig, dict[str, dict]]:
    """The config train.py gets, and the arguments of its model and data `_target_`s."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg), {node: added_keys(cfg[node]) for node in ("model", "data")}


def pretrained_llama(directory: Path, head_scale: float = 1.0) -> int:
    """A tiny random Llama saved with a byte-level BPE tokenizer trained on TEXT (up to 300 tokens, as many as BPE
    finds), its LM head's weights times `head_scale`; returns the vocabulary's size."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")
    fast.save_pretrained(directory)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(fast), max_position_embeddings=128, **shape))
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(directory)
    return len(fast)


def test_hf_llama_composes_to_its_hf_config_and_typos_are_still_refused():
    config, arguments = composed("model=hf_llama", "model.config.hidden_size=32")
    assert isinstance(config.model, HFModelConfig)
    assert config.model.config["model_type"] == "llama" and config.model.config["hidden_size"] == 32
    assert config.model.config["vocab_size"] == 256 and config.model.seq_len == 128
    assert arguments == {"model": {}, "data": {}}
    typos = [("model=hf_llama", "model.confg=3"), ("model=hf_llama", "model.n_layers=3")]
    typos += [("model=hf_llama", "model._target_=my_package.MyModule")]
    typos += [("model._target_=my_package.MyModule", "model.n_layerz=3")]
    for overrides, schema in zip(typos, ["HFModelConfig"] * 3 + ["ModelConfig"], strict=True):
        with pytest.raises(ConfigCompositionException) as refused:
            composed(*overrides)
        key = overrides[1].split("=")[0].removeprefix("model.")
        assert f"Key '{key}' not in '{schema}'" in error_line(refused.value)  # as train.py prints it


def test_a_target_takes_the_keys_added_to_its_node():
    config, arguments = composed(
        "model._target_=my_package.MyModule", "+model.width=3", "data._target_=my_package.MyData", "+data.rows={n: 8}"
    )
    assert config.model._target_ == "my_package.MyModule" and config.data._target_ == "my_package.MyData"
    assert arguments == {"model": {"width": 3}, "data": {"rows": {"n": 8}}}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"text_file": "a.txt", "dataset_dir": "d"}, "data.text_file=a.txt and data.dataset_dir=d: give one source"),
        ({"text_file": "a.txt", "_target_": "p.D"}, "data.text_file=a.txt and data._target_=p.D: give one source"),
        ({"column": "ids"}, "data.column='ids': name a column of data.dataset_dir"),
    ],
)
def test_data_sources_are_one_at_a_time(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        DataConfig(**fields)


def test_an_hf_model_is_planned_from_its_config():
    """6 pipeline layers, each decoder layer the FLOPs of its projections (grouped-query k, v), gated MLP and
    attention over 128 tokens; the weights' bytes those of HF's own model, in fp32."""
    config, arguments = composed("model=hf_llama")
    profile = check_model(config, arguments["model"], data_vocab=256)
    t, h, kv, inner, vocab = 128, 64, 32, 128, 256
    decoder = 2 * t * h * (h + 2 * kv + h) + 3 * 2 * t * h * inner + 2 * 2 * t * t * h
    assert [layer.forward_flops for layer in profile.layers] == [0.0, *[decoder] * 4, 2 * t * h * vocab]
    assert profile.num_layers == 6 and profile.tokens_per_sample == 128
    hf_model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**config.model.config))
    assert profile.param_bytes == 4 * sum(p.numel() for p in hf_model.parameters())
    model = build_model(config, arguments["model"])
    assert isinstance(model, HFCausalLM) and all(p.is_meta for p in model.parameters())


def test_an_hf_model_with_a_lora_adapter_is_planned_with_its_weights_frozen():
    """`model.lora.r=4` on the query and value projections: rank-4 A and B matrices train, every other weight is
    frozen, in the profile the planner gets and in the module the ranks build."""
    config, arguments = composed("model=hf_llama", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]")
    profile = check_model(config, arguments["model"], data_vocab=256)
    h, kv, layers = 64, 32, 4
    adapter = layers * 4 * ((h * 4 + 4 * h) + (h * 4 + 4 * kv))  # fp32 A (4 x in) and B (out x 4), q and v
    assert profile.trained_bytes == adapter
    model = build_model(config, arguments["model"])
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 4 * layers and all("lora_" in name for name in trained)


def test_the_built_in_data_yields_pairs_for_the_gpt_and_dicts_for_hf_models():
    config, _ = composed("data.corpus_bytes=20000", "data.global_batch=4")
    hf_config, _ = composed("model=hf_llama", "data.corpus_bytes=20000", "data.global_batch=4")
    pairs, dicts = build_data(config, {}), build_data(hf_config, {})
    for data in (pairs, dicts):
        data.setup("fit")
    inputs, targets = next(iter(pairs.train_dataloader()))
    batch = next(iter(dicts.train_dataloader()))
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    assert torch.equal(batch["input_ids"], inputs) and torch.equal(batch["labels"], inputs)  # HF's loss shifts them
    assert torch.equal(batch["attention_mask"], torch.ones(4, 128, dtype=torch.long))
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    yours, _ = composed("model._target_=my_package.MyModule", "data.batch_format=dicts")
    assert yours.data.batch_format is BatchFormat.dicts and build_data(yours, {}).dict_batches


def test_a_text_file_is_its_bytes_or_its_tokenizers_ids(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    assert TextFile(str(path)).tokens().tolist() == list(TEXT.encode())
    pretrained_llama(tmp_path / "llama")
    expected = tf.AutoTokenizer.from_pretrained(tmp_path / "llama")(TEXT)["input_ids"]
    tokens = TextFile(str(path), tokenizer=str(tmp_path / "llama")).tokens()
    assert tokens.tolist() == expected and len(expected) < len(TEXT.encode()) / 2


def test_a_pretrained_directorys_tokenizer_tokenises_text_and_sizes_the_vocabulary(tmp_path):
    directory = tmp_path / "llama"
    vocabulary = pretrained_llama(directory)
    (tmp_path / "corpus.txt").write_text(TEXT)
    text = (f"model.pretrained={directory}", f"data.text_file={tmp_path / 'corpus.txt'}")
    config, arguments = composed("model=hf_llama", *text)
    assert check_data(config, arguments["data"]) == vocabulary > 256
    profile = check_model(config, arguments["model"], data_vocab=vocabulary)
    assert profile.layers[-1].forward_flops == 2 * 128 * 32 * vocabulary  # the directory's model, not the YAML's
    data = build_data(config, arguments["data"])
    assert data.source == TextFile(str(tmp_path / "corpus.txt"), tokenizer=str(directory)) and data.dict_batches
    bytes_config, _ = composed("model=hf_llama", text[0])  # the default corpus stays bytes
    assert check_data(bytes_config, {}) == 256 and build_data(bytes_config, {}).source == StdlibBytes(2_000_000)


def test_a_saved_dataset_gives_its_token_ids_or_its_text(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [[7, 8, 9], [1, 2], [300, 4]]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": rows})}).save_to_disk(tmp_path / "ids")
    datasets.Dataset.from_dict({"body": ["ab", "ç\n"], "n": [1, 2]}).save_to_disk(tmp_path / "text")
    assert SavedDataset(str(tmp_path / "ids")).tokens().tolist() == [7, 8, 9, 1, 2, 300, 4]
    assert SavedDataset(str(tmp_path / "text"), column="body").tokens().tolist() == list("abç\n".encode())
    config, _ = composed(f"data.dataset_dir={tmp_path / 'ids'}")
    assert check_data(config, {}) is None  # token ids: the model's vocabulary is the user's to match
    for column, message in [("null", "has neither of ['input_ids', 'text']"), ("n", "holds int values")]:
        config, _ = composed(f"data.dataset_dir={tmp_path / 'text'}", f"data.column={column}")
        with pytest.raises(ValueError, match=re.escape(message)):
            check_data(config, {})


def test_a_missing_datasets_package_is_named_with_its_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without it imports
    config, _ = composed(f"data.dataset_dir={tmp_path}")
    with pytest.raises(ConfigError, match=re.escape("needs the `datasets` package, an optional extra: pip install")):
        check_data(config, {})


def test_windows_of_one_token_stream_split_over_the_replicas():
    data = TokenDataModule(StdlibBytes(50_000), seq_len=32, global_batch=8, val_fraction=0.1, dict_batches=True)
    data.setup("fit")
    assert len(data.train_set) == (45_000 - 1) // 32 and len(data.val_set) == (5_000 - 1) // 32
    first = data.train_set[3]["input_ids"]
    assert first.tolist() == list(StdlibBytes(50_000).tokens()[96:128].tolist())
    assert sum(1 for _ in data.train_dataloader()) == len(data.train_set) // 8


def empty_dir(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=hf_llama", "model.pretrained={tmp}/nope"], "model.pretrained={tmp}/nope: no such directory"),
        (["model=hf_llama", "model.pretrained={tmp}/empty"], "{tmp}/empty holds neither model.safetensors nor"),
        (["model=hf_llama", "+model.config.hidden_sise=3"], "model.config.hidden_sise: not a field of LlamaConfig"),
        (["model=hf_llama", "model.config.model_type=lama"], "model.config.model_type=lama: not a transformers model"),
        (["model=hf_llama", "model.config.hidden_size=30"], "model.config: ValueError: The hidden size (30) is not a"),
        (["model=hf_llama", "model.seq_len=256"], "model.seq_len=256: above the model's max_position_embeddings=128"),
        (["model=hf_llama", "model.config.vocab_size=200"], "a vocabulary of 200 tokens, but the data's (bytes, or"),
        (["model._target_=my_missing_package.MyModule"], "cannot import it (No module named 'my_missing_package')"),
        (["model._target_=json.JSONDecoder"], "model._target_=json.JSONDecoder: <class 'json.decoder.JSONDecoder'> is"),
        (["model._target_=holmes_lightning.recipes.GPT", "+model.widht=3"], "unexpected keyword argument 'widht'"),
        (["+model.width=3"], "+model.width: keys added to model are the arguments of your own class; set model._tar"),
        (["data._target_=holmes_lightning.recipes.GPT"], "GPT'> is not a LightningDataModule subclass"),
        (["data.text_file={tmp}/nope.txt"], "data.text_file={tmp}/nope.txt: no such file"),
        (["data.dataset_dir={tmp}/nope"], "data.dataset_dir={tmp}/nope: no such directory"),
        (["model=hf_llama", "+model.width=3"], "+model.width: keys added to model are the arguments of your own"),
        (["model=hf_llama", "data.batch_format=pairs"], "data.batch_format=pairs: model=hf_llama takes dicts; leave"),
        (["data.batch_format=dicts"], "data.batch_format=dicts: model=gpt_tiny takes pairs; leave it null"),
        (["model=hf_llama", "model.lora.r=-1"], "model.lora.r=-1: must be > 0 for an adapter, or 0 for none"),
        (["model=hf_llama", "model.lora.r=4", "model.lora.target_modules=[nope]"], "Target modules {{'nope'}} not"),
        (["model=hf_llama", "model.lora.rank=4"], "Could not override 'model.lora.rank': Key 'rank' not in 'LoraSett"),
    ],
    ids=[
        "no pretrained directory",
        "no weights",
        "HF config typo",
        "model type",
        "HF config value",
        "sequence length",
        "vocabulary",
        "target module",
        "target kind",
        "target arguments",
        "added key without target",
        "data target kind",
        "text file",
        "dataset directory",
        "added key to an HF model",
        "pairs for an HF model",
        "dicts for the GPT",
        "LoRA rank",
        "LoRA modules",
        "LoRA typo",
    ],
)
def test_train_py_refuses_bad_models_and_data_before_any_rank_starts(
    overrides,
    message,
    tmp_path,
    train_module,
    monkeypatch,
    capsys,
):
    empty_dir(tmp_path)
    args = [override.format(tmp=tmp_path) for override in overrides]
    result = run_cli(train_module, monkeypatch, capsys, *args, f"output_dir={tmp_path}")
    assert_clean_error(*result, message.format(tmp=tmp_path))


def test_train_py_says_the_datasets_package_is_missing(tmp_path, train_module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)
    result = run_cli(train_module, monkeypatch, capsys, f"data.dataset_dir={tmp_path}", f"output_dir={tmp_path}")
    assert_clean_error(*result, "pip install 'holmes-lightning[datasets]'")
