"""Training recipes for holmes-lightning: a byte-level GPT on text every machine has."""

from holmes_lightning.recipes.callbacks import RunSummary, throughput_monitor
from holmes_lightning.recipes.data import ByteCorpusDataModule, stdlib_corpus
from holmes_lightning.recipes.gpt import GPT

__all__ = ["GPT", "ByteCorpusDataModule", "RunSummary", "stdlib_corpus", "throughput_monitor"]
