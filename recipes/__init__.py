"""Training recipes for holmes-lightning: a byte-level GPT on text every machine has."""

from recipes.callbacks import RunSummary, throughput_monitor
from recipes.data import ByteCorpusDataModule, stdlib_corpus
from recipes.gpt import GPT

__all__ = ["GPT", "ByteCorpusDataModule", "RunSummary", "stdlib_corpus", "throughput_monitor"]
