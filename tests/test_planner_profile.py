"""Model profiles: measured with FlopCounterMode on the recipe's GPT, and analytic from a model config."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.measure import profile_modules
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanOptions, best_plan
from holmes_lightning.recipes.gpt import GPT
from holmes_lightning.topology import Topology

SHAPE = {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256}


@pytest.fixture(scope="module")
def measured() -> ModelProfile:
    torch.manual_seed(0)
    model = GPT(**SHAPE)
    return profile_modules(model.pipeline_layers(), torch.randint(0, 256, (2, 32)), "gpt", time_repeats=2)


def test_measured_and_analytic_profiles_agree(measured):
    analytic = ModelProfile.from_gpt(ModelConfig(**SHAPE), bytes_per_value=4)
    assert measured.num_layers == analytic.num_layers == SHAPE["n_layers"] + 2
    assert [layer.name.split(":")[1] for layer in measured.layers] == ["Embedding", "Block", "Block", "Head"]
    assert [la.param_bytes for la in measured.layers] == [la.param_bytes for la in analytic.layers]
    assert [la.activation_bytes for la in measured.layers] == [la.activation_bytes for la in analytic.layers]
    assert measured.tokens_per_sample == analytic.tokens_per_sample == 32
    s, h = SHAPE["seq_len"], SHAPE["d_model"]
    attention_scores = 4 * s * s * h  # CPU's fused scaled_dot_product_attention is not counted by FlopCounterMode
    for ours, theirs in zip(measured.layers[1:], analytic.layers[1:], strict=True):
        is_block = ours.name.endswith("Block")
        assert ours.forward_flops == theirs.forward_flops - (attention_scores if is_block else 0)
        assert ours.backward_flops == 2 * ours.forward_flops
        assert ours.weight_flops == theirs.weight_flops  # the linear layers' gradients: what a zero-bubble W runs
    assert measured.layers[0].weight_flops == analytic.layers[0].weight_flops == 0.0  # an embedding's backward: none
    assert all(la.stash_bytes > 0 for la in measured.layers)


def test_measured_seconds_drive_the_plan(measured):
    assert all(layer.measured and layer.forward_s > 0 and layer.backward_s > 0 for layer in measured.layers)
    clusters = [
        {"name": "A", "nodes": 1, "nic": {"kind": "infiniband", "gbps": 200}},
        {"name": "B", "nodes": 1, "device_tflops": 156, "nic": {"kind": "roce", "gbps": 200}},
    ]
    topology = Topology.from_config({"name": "cpu_lab", "device_tflops": 312, "clusters": clusters})
    result = best_plan(topology, measured, BatchSettings(4), options=PlanOptions(partition="uniform", pp=2))
    for stage in result.stages:
        (start, stop), slowdown = stage.chunks[0], 312 / stage.device_tflops  # B's devices take twice as long
        seconds = sum(layer.forward_s for layer in measured.layers[start:stop]) * slowdown * result.microbatch_size
        assert stage.forward_s[0] == pytest.approx(seconds)
    assert {stage.device_tflops for stage in result.stages} == {312, 156}


def test_analytic_gpt_7_5b_size():
    profile = ModelProfile.from_gpt(
        ModelConfig(name="gpt_7_5b", n_layers=36, d_model=4096, n_heads=32, seq_len=2048, vocab_size=50304)
    )
    assert profile.param_bytes / 2 == pytest.approx(7.66e9, rel=0.01)  # bf16 weights of ~7.7B parameters
    assert profile.flops_per_sample == pytest.approx(6 * 7.66e9 * 2048, rel=0.1)  # ~6 N per token


def test_a_model_on_meta_keeps_for_backward_what_its_fused_attention_keeps():
    """On meta, attention takes torch's math path, which keeps the s x s probabilities for backward; the profile counts
    what CPU's fused kernel keeps (as CUDA's do), so a model built on meta is planned with the memory it runs with."""
    shape = {**SHAPE, "seq_len": 128}
    sample = torch.randint(0, 256, (2, 128))
    with torch.device("meta"):
        on_meta = profile_modules(GPT(**shape).pipeline_layers(), sample)
    on_cpu = profile_modules(GPT(**shape).pipeline_layers(), sample)
    assert [la.stash_bytes for la in on_meta.layers] == [la.stash_bytes for la in on_cpu.layers]
    with sdpa_kernel(SDPBackend.MATH):
        math_path = profile_modules(GPT(**shape).pipeline_layers(), sample)
    s, h, heads = 128, SHAPE["d_model"], SHAPE["n_heads"]
    probabilities = heads * s * s * 4  # fp32, per sequence: what the math path keeps beyond the fused kernel
    assert math_path.layers[1].stash_bytes - on_meta.layers[1].stash_bytes == pytest.approx(probabilities, rel=0.01)
    attention_scores = 4 * s * s * h  # FLOPs: meta counts the math path's matmuls, CPU's fused kernel none
    assert on_meta.layers[1].forward_flops == on_cpu.layers[1].forward_flops + attention_scores


class Returning(torch.nn.Module):
    """A linear layer whose output `wrap` packs, e.g. with something a pipeline stage cannot send."""

    def __init__(self, wrap) -> None:
        super().__init__()
        self.linear, self.wrap = torch.nn.Linear(4, 4), wrap

    def forward(self, inputs: torch.Tensor) -> object:
        return self.wrap(self.linear(inputs))


@pytest.mark.parametrize(
    ("wrap", "returned"), [(lambda hidden: (hidden, None), "Tensor, NoneType"), (lambda hidden: {"h": hidden}, "dict")]
)
def test_a_layer_returning_what_a_stage_cannot_send_is_named(wrap, returned):
    with pytest.raises(TypeError, match=f"pipeline layer Returning returned {returned}: .* a tuple of tensors"):
        profile_modules([Returning(wrap), torch.nn.Linear(4, 2)], torch.zeros(2, 4))


def test_frozen_parameters_are_counted_apart():
    """`requires_grad=False` parameters are the layer's `frozen_bytes` (a frozen embedding; LoRA's frozen base)."""
    layers = [torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
    layers[0].requires_grad_(False)
    layers[1].weight.requires_grad_(False)
    profile = profile_modules(layers, torch.zeros(2, 3, dtype=torch.long))
    assert [layer.frozen_bytes for layer in profile.layers] == [16 * 8 * 4, 8 * 8 * 4, 0]
    assert [layer.trained_bytes for layer in profile.layers] == [0, 8 * 4, (8 * 4 + 4) * 4]
