"""Train transformers decoder-only causal LMs with HolmesStrategy: `HFCausalLM` wraps one as a LightningModule that
defines the pipeline contract; `hf_pipeline_layers` cuts a model into pipeline layers."""

from holmes_lightning.hf.module import HFCausalLM
from holmes_lightning.hf.structure import UnrecognisedModelError, hf_pipeline_layers

__all__ = ["HFCausalLM", "UnrecognisedModelError", "hf_pipeline_layers"]
