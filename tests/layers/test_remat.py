"""Remat policies: identical gradients, and backward reruns exactly the ops the policy does not keep."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.layers.remat import current_activation_name
from axtorch.models.causal_lm import CausalLMInput
from axtorch.plan.memory import activation_bytes
from axtorch.train.config import Precision
from axtorch.train.trainer import build_model

#: A small mixture of experts (mixtral_tiny: 4 layers, top 2 of 8 SwiGLU experts of width 256).
MOE = ["model=mixtral_tiny", "model.vocab_size=512"]


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _NameRecorder(TorchDispatchMode):
    """The activation names in force while the forward's ops dispatch."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = current_activation_name()
        if name is not None:
            self.names.add(name)
        return func(*args, **(kwargs or {}))


def _gradients_and_backward_ops(*overrides):
    config = load_experiment_config(["experiment=debug", *overrides])
    model = build_model(config, torch.device("cpu"))
    ids = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(CausalLMInput(ids)).logits.pow(2).mean()
    with _OpCounter() as counter:
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, counter.counts


def test_every_policy_gives_the_gradients_of_no_remat():
    reference, _ = _gradients_and_backward_ops()
    for policy in ("full", "selective"):
        gradients, _ = _gradients_and_backward_ops(f"model/remat={policy}")
        for name, grad in reference.items():
            torch.testing.assert_close(gradients[name], grad, rtol=0, atol=1e-7, msg=f"{policy}: {name}")


def test_full_remat_reruns_each_layer_and_selective_keeps_the_named_activations():
    _, plain = _gradients_and_backward_ops()
    _, full = _gradients_and_backward_ops("model/remat=full")
    _, selective = _gradients_and_backward_ops("model/remat=selective")
    _, selective_attention_only = _gradients_and_backward_ops(
        "model/remat=selective", "model.decoder.remat.save=[attention_context]"
    )
    layers = 2
    assert "silu" not in plain  # backward alone never runs the forward activation
    assert full["silu"] == layers  # full remat recomputes every layer's SwiGLU
    assert "silu" not in selective  # feed_forward_hidden is kept: its ops are not rerun
    assert selective_attention_only["silu"] == layers
    # Gate and up projections (2 matmuls per layer) are inside the kept feed_forward_hidden scope.
    assert full["mm"] - selective["mm"] == 2 * layers
    assert selective["mm"] > plain["mm"]  # the rest (attention projections, down projection) reruns


def test_remat_is_skipped_when_no_gradient_is_recorded():
    config = load_experiment_config(["experiment=debug", "model/remat=full"])
    model = build_model(config, torch.device("cpu"))
    with torch.no_grad(), _OpCounter() as counter:
        model(CausalLMInput(torch.zeros(1, 8, dtype=torch.long)))
    assert counter.counts["silu"] == 2


def test_selective_remat_rejects_names_no_layer_gives():
    with pytest.raises(ConfigError, match=r"model.decoder.remat.save.*attention_scores"):
        load_experiment_config(
            ["experiment=debug", "model/remat=selective", "model.decoder.remat.save=[attention_scores]"]
        )


def test_selective_remat_can_keep_the_attention_context_so_attention_is_not_rerun():
    _, full = _gradients_and_backward_ops("model/remat=full")
    _, kept = _gradients_and_backward_ops("model/remat=selective", "model.decoder.remat.save=[attention_context]")
    attention_ops = [name for name in full if "scaled_dot_product" in name and "backward" not in name]
    assert attention_ops and all(full[name] == 2 for name in attention_ops)
    assert not any(name in kept for name in attention_ops)


def test_the_error_names_the_activations_this_model_gives():
    with pytest.raises(ConfigError) as raised:
        load_experiment_config([*MOE, "model/remat=selective", "model.decoder.remat.save=[expert_hidden]"])
    error = raised.value
    assert (error.key, error.value) == ("model.decoder.remat.save", ["expert_hidden"])
    assert "attention_context" in error.allowed and "feed_forward_hidden" in error.allowed


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model/ffn=gelu"],
        MOE,
        [*MOE, "model/shared_experts=swiglu", "model.decoder.layer.feed_forward.shared_experts.hidden_dim=64"],
        [*MOE, "model.decoder.layer.feed_forward.capacity_factor=1.5"],
    ],
    ids=["swiglu", "gelu_mlp", "moe_dropless", "moe_shared", "moe_capacity"],
)
def test_layers_name_exactly_the_activations_their_configs_declare(overrides):
    config = load_experiment_config(["experiment=debug", *overrides])
    model = build_model(config, torch.device("cpu"))
    with _NameRecorder() as recorder:
        model(CausalLMInput(torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))))
    assert recorder.names == set(config.model.decoder.layer.activation_widths(config.model.dim))


def test_moe_under_selective_remat_keeps_its_experts_hidden_activations():
    _, full = _gradients_and_backward_ops(*MOE, "model/remat=full")
    _, selective = _gradients_and_backward_ops(*MOE, "model/remat=selective")
    _, attention_only = _gradients_and_backward_ops(
        *MOE, "model/remat=selective", "model.decoder.remat.save=[attention_context]"
    )
    assert full["silu"] >= 4  # every layer's experts rerun their SwiGLU (one call per expert with tokens)
    assert attention_only["silu"] == full["silu"]
    assert "silu" not in selective  # feed_forward_hidden names the experts' hidden: kept, not rerun


def test_the_planner_counts_what_the_moe_layer_declares():
    def kept(*save):
        config = load_experiment_config([*MOE, "model/remat=selective", f"model.decoder.remat.save=[{','.join(save)}]"])
        return activation_bytes(config.model, batch=2, seq=64, tensor_parallel=1, precision=Precision.fp32)

    # Each token's top 2 of 8 experts keep 256 hidden features each, in each of the 4 layers.
    hidden = kept("attention_context", "feed_forward_hidden") - kept("attention_context")
    assert hidden == 4 * 4 * 2 * 64 * (2 * 256)
