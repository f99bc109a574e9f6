"""`ModelProfile`: what each pipeline layer costs (FLOPs or measured seconds) and how many bytes it holds and sends."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol


class GPTShape(Protocol):
    """The shape of a GPT (what `holmes_lightning.cli.config.ModelConfig` holds)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int


@dataclass(frozen=True)
class LayerProfile:
    """One pipeline layer, per sample (one sequence).

    `forward_flops`/`backward_flops` drive the analytic cost; `forward_s`/`backward_s`, when measured, replace them
    (seconds per sample on a device of `ModelProfile.measured_tflops` peak TFLOPS; None: the topology's fastest
    device, so slower clusters scale by their `device_tflops`). `param_bytes` are the layer's weights,
    `activation_bytes` its output (what a pipeline stage boundary after it sends), `stash_bytes` what autograd keeps
    for the backward pass. `weight_flops`: of `backward_flops`, those of the weight gradients (what a zero-bubble
    schedule runs apart); None: half of them in a layer with weights (a matrix multiply's two gradients cost alike).
    `frozen_bytes`: of `param_bytes`, those of parameters that do not train (`requires_grad=False`): no gradients,
    optimizer states or gradient sync, only the weights and their gathering.
    """

    name: str
    forward_flops: float
    backward_flops: float
    param_bytes: float
    activation_bytes: float
    stash_bytes: float
    forward_s: float | None = None
    backward_s: float | None = None
    weight_flops: float | None = None
    frozen_bytes: float = 0.0

    @property
    def trained_bytes(self) -> float:
        return self.param_bytes - self.frozen_bytes

    @property
    def measured(self) -> bool:
        return self.forward_s is not None and self.backward_s is not None

    @property
    def weight_share(self) -> float:
        """The part of the backward that computes weight gradients (of its FLOPs, so of its seconds)."""
        if self.weight_flops is not None:
            return self.weight_flops / self.backward_flops if self.backward_flops > 0 else 0.0
        return 0.5 if self.param_bytes > 0 else 0.0


@dataclass(frozen=True)
class ModelProfile:
    """A model as an ordered list of pipeline layers (for a GPT: embedding, blocks, head); `input_bytes`: the first
    layer's inputs per sample (what a checkpointed first layer keeps)."""

    name: str
    layers: tuple[LayerProfile, ...]
    tokens_per_sample: int
    measured_tflops: float | None = None
    input_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"profile {self.name!r} has no layers; a pipeline needs at least one")
        if self.tokens_per_sample <= 0:
            raise ValueError(f"profile {self.name!r}: tokens_per_sample={self.tokens_per_sample} must be > 0")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample through the whole model."""
        return sum(layer.forward_flops + layer.backward_flops for layer in self.layers)

    @property
    def param_bytes(self) -> float:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def trained_bytes(self) -> float:
        return sum(layer.trained_bytes for layer in self.layers)

    def input_of(self, index: int) -> float:
        """Bytes per sample of layer `index`'s input: the previous layer's output, or the model's inputs."""
        return self.layers[index - 1].activation_bytes if index else self.input_bytes

    @classmethod
    def from_gpt(cls, model: GPTShape, bytes_per_value: int = 2) -> ModelProfile:
        """Analytic profile of a GPT shape: `[embedding, block x n_layers, head]` (pre-LN blocks, biases, 4x MLP).

        FLOPs count matrix multiplies (2 per multiply-add); attention scores over the full sequence; backward = 2x
        forward, of which the weight gradients are the linear layers' forward FLOPs once. `bytes_per_value` is the
        training dtype's size (2 for bf16/fp16, 4 for fp32). The block's stash is Korthikanti et al.'s
        34·s·h + 5·a·s² values at 16 bits, scaled to the dtype; the head's counts the logits twice, as `measure` does
        (the pipeline keeps them for the loss, the loss keeps its log-probabilities).
        """
        s, h, a, vocab = model.seq_len, model.d_model, model.n_heads, model.vocab_size
        width = bytes_per_value
        hidden_out = s * h * width
        block_flops = 24 * s * h * h + 4 * s * s * h
        block_params = 12 * h * h + 13 * h
        block_stash = (34 * s * h + 5 * a * s * s) * width / 2
        head_flops = 2 * s * h * vocab
        embedding = LayerProfile("embedding", 0.0, 0.0, (vocab + s) * h * width, hidden_out, 0.0, weight_flops=0.0)
        block = LayerProfile(
            "block",
            block_flops,
            2 * block_flops,
            block_params * width,
            hidden_out,
            block_stash,
            weight_flops=24 * s * h * h,
        )
        logits = s * vocab * width
        head_params = (vocab * h + 2 * h) * width
        head_stash = 2 * hidden_out + 2 * logits  # norm's input and output; the logits and the loss's copy of them
        head = LayerProfile(
            "head", head_flops, 2 * head_flops, head_params, logits, head_stash, weight_flops=head_flops
        )
        blocks = tuple(replace(block, name=f"block{i}") for i in range(model.n_layers))
        return cls(model.name, (embedding, *blocks, head), tokens_per_sample=s, input_bytes=s * 8)  # int64 token ids
