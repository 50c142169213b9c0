"""A KV-cache forward builds its rotary tables and masks once for all layers (``SharedValues``):
the same logits as every layer building its own, one table per distinct RoPE schedule and one mask
per distinct mask and cache shape."""

import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.layers.attention_mask import CausalMask, SlidingWindowMask
from axtorch.layers.relative_position import RotaryEmbedding
from axtorch.layers.seams import fill_seams
from axtorch.layers.transformer import LayerRunner, TransformerLayerInput
from axtorch.models import CausalLMInput
from axtorch.train.trainer import build_model


def _each_layer_its_own_tables(decoder, inputs):
    """A ``LayerRunner`` that passes no ``SharedValues``: every layer computes its own."""
    hidden_states = inputs.hidden_states
    for layer, cache in zip(decoder.layers, inputs.kv_caches):
        hidden_states = layer(TransformerLayerInput(hidden_states, inputs.positions, cache)).hidden_states
    return hidden_states, None


@torch.no_grad()
def _decode(model, tokens, prefill=6):
    """Logits of a prefill, then of one token per call, and the tables built by each decode step."""
    caches = model.allocate_kv_caches(2, tokens.shape[1], dtype=torch.float32, device=torch.device("cpu"), max_write=6)
    logits = [model(CausalLMInput(input_ids=tokens[:, :prefill], kv_caches=caches)).logits]
    built = []
    for i in range(prefill, tokens.shape[1]):
        calls.clear()
        step = CausalLMInput(input_ids=tokens[:, i : i + 1], positions=torch.full((2, 1), i), kv_caches=caches)
        logits.append(model(step).logits)
        built.append(sorted(calls))
    return torch.cat(logits, dim=1), built


calls: list[str] = []


def test_a_decode_step_builds_each_table_once_with_the_logits_of_per_layer_tables(monkeypatch):
    # Six layers: local, local, global repeated; local: window 16, RoPE base 1e4; global: base 1e6.
    torch.manual_seed(0)
    model = build_model(load_experiment_config(["experiment=debug", "model=local_global_tiny"]), torch.device("cpu"))
    model.eval()
    for cls, name in ((RotaryEmbedding, "cos_sin"), (CausalMask, "forward"), (SlidingWindowMask, "forward")):
        original = getattr(cls, name)
        monkeypatch.setattr(
            cls, name, lambda self, *a, _o=original, _n=f"{cls.__name__}.{name}": calls.append(_n) or _o(self, *a)
        )
    tokens = torch.randint(0, 4000, (2, 30), generator=torch.Generator().manual_seed(1))  # past the window

    shared, built = _decode(model, tokens)
    kinds = ["CausalMask.forward", "RotaryEmbedding.cos_sin", "RotaryEmbedding.cos_sin", "SlidingWindowMask.forward"]
    assert built == [kinds] * 24  # two RoPE bases, two masks: once each, not once per layer
    fill_seams(model, LayerRunner, _each_layer_its_own_tables)
    own, built = _decode(model, tokens)
    assert len(built[0]) == 2 * 6  # a table and a mask per layer
    torch.testing.assert_close(shared, own, atol=0, rtol=0)
