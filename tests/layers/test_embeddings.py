"""Input embeddings: token-embedding scaling, the learned absolute position table, embedding dropout."""

import math

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.layers.embedding import EmbeddingConfig
from axtorch.layers.position_embedding import LearnedPositionEmbeddingConfig
from axtorch.models import CausalLMInput


def _table(config, vocab_size=11, dim=48, dtype=torch.float64):
    embedding = config.build(vocab_size, dim).to(dtype)
    torch.manual_seed(0)
    embedding.reset_parameters()
    return embedding


def _debug_model(*overrides):
    config = load_experiment_config(["model=llama_debug", *overrides]).model
    torch.manual_seed(0)
    model = config.build().double()
    model.init_weights()
    return model


IDS = torch.tensor([[3, 0, 10, 7]])


def test_scale_by_sqrt_dim_multiplies_the_lookup_but_not_the_tied_head():
    plain = _table(EmbeddingConfig())
    scaled = _table(EmbeddingConfig(scale_by_sqrt_dim=True, multiplier=0.5))

    assert torch.equal(scaled(IDS), plain(IDS) * (0.5 * math.sqrt(48)))
    hidden = torch.randn(1, 4, 48, dtype=torch.float64)
    assert torch.equal(scaled.attend(hidden), plain.attend(hidden))


def test_bf16_lookup_is_scaled_by_the_factor_rounded_to_bf16_as_gemma_does():
    scaled = _table(EmbeddingConfig(scale_by_sqrt_dim=True), dtype=torch.bfloat16)
    factor = torch.tensor(math.sqrt(48), dtype=torch.bfloat16)  # 6.9375, not 6.9282...
    assert torch.equal(scaled(IDS), scaled.weight[IDS] * factor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scaled_lookup_compiles_into_one_graph_with_the_same_values(dtype):
    # The factor's rounding to the dtype happens at build time: reading a tensor back in the
    # forward split a compiled decode step in two (Gemma's scaled embeddings).
    scaled = _table(EmbeddingConfig(scale_by_sqrt_dim=True), dtype=dtype)
    assert torch._dynamo.explain(scaled)(IDS).graph_break_count == 0
    assert torch.equal(torch.compile(scaled, backend="eager")(IDS), scaled(IDS))


def test_learned_position_table_is_looked_up_by_absolute_position():
    table = LearnedPositionEmbeddingConfig().build(16, 8).double()
    torch.manual_seed(0)
    table.reset_parameters()
    positions = torch.tensor([[0, 1, 2], [9, 10, 15]])
    assert torch.equal(table(positions), table.weight[positions])


@pytest.mark.parametrize("positions", [[[14, 15, 16]], [[-1, 0, 1]]])
def test_positions_outside_the_table_are_an_error_naming_max_seq_len(positions):
    table = LearnedPositionEmbeddingConfig().build(16, 8)
    with pytest.raises(
        ValueError, match=r"outside the learned position table, which covers 0\.\.15 \(model\.max_seq_len=16\)"
    ):
        table(torch.tensor(positions))


def test_causal_lm_adds_the_position_table_to_the_token_embeddings():
    model = _debug_model("model/position_embedding=learned")
    assert tuple(model.position_embedding.weight.shape) == (256, 64)
    assert model.position_embedding.weight.std().item() == pytest.approx(0.02, rel=0.1)
    shifted = CausalLMInput(input_ids=IDS, positions=torch.arange(4)[None] + 100)
    # The same tokens at other positions give other logits: positions reach the model outside attention.
    assert not torch.allclose(model(CausalLMInput(input_ids=IDS)).logits, model(shifted).logits)
    with pytest.raises(ValueError, match="max_seq_len=256"):
        model(CausalLMInput(input_ids=torch.zeros(1, 257, dtype=torch.long)))


def test_embedding_dropout_acts_in_training_only():
    model = _debug_model("model.embedding_dropout=0.5")
    captured = []
    model.decoder.register_forward_pre_hook(lambda module, args: captured.append(args[0].hidden_states))
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    lookup = model.embedding(ids)

    model.eval()(CausalLMInput(input_ids=ids))
    model.train()(CausalLMInput(input_ids=ids))

    evaluated, trained = captured
    assert torch.equal(evaluated, lookup)
    kept = trained != 0
    assert 0.4 < kept.double().mean() < 0.6
    assert torch.allclose(trained[kept], 2 * lookup[kept])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.embedding_dropout=1.0", "model.embedding_dropout"),
        ("model.embedding.multiplier=0", "model.embedding.multiplier"),
    ],
)
def test_bad_embedding_settings_are_config_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_experiment_config(["model=llama_debug", override])
    assert info.value.key == key
