"""Qwen2 and Qwen3 with a sliding window in some layers only (HF ``layer_types``, or the older
``max_window_layers``) through HF both ways: the logits of transformers in float64.

Such a stack imports as a decoder whose ``local`` variant slides and whose ``global`` layers
attend to everything; export writes ``layer_types`` back, with the ``max_window_layers`` that
says the same to transformers versions that read no ``layer_types``. Five layers and 19 tokens
against a window of 5, so that every layer's mask changes the logits.
"""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_shapes import HF_SHAPE

from axtorch.interop import from_hf, to_hf
from axtorch.interop.families import CannotExpress, config_from_hf, family_of
from axtorch.interop.gguf_export import to_gguf
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.models import CausalLMInput

pytestmark = pytest.mark.usefixtures("float64_hf_rmsnorm")

S, F = "sliding_attention", "full_attention"
WINDOW = {"use_sliding_window": True, "sliding_window": 5}
#: case -> (HF config class, fields beyond HF_SHAPE, whether config.json keeps transformers'
#: ``layer_types`` (else it says only ``max_window_layers``, as files from before transformers 4.53 do),
#: the decoder pattern the import must have).
CASES = {
    "qwen2-max_window_layers": (
        transformers.Qwen2Config,
        dict(max_window_layers=2, **WINDOW),
        False,
        ["global", "global", "local", "local", "local"],
    ),
    "qwen2-layer_types": (
        transformers.Qwen2Config,
        dict(layer_types=[S, F, S, F, S], **WINDOW),
        True,
        ["local", "global"],
    ),
    "qwen3-layer_types": (
        transformers.Qwen3Config,
        dict(head_dim=16, layer_types=[S, S, F, S, S], **WINDOW),
        True,
        ["local", "local", "global"],
    ),
    "qwen3-max_window_layers-biases": (
        transformers.Qwen3Config,
        dict(head_dim=16, attention_bias=True, max_window_layers=4, **WINDOW),
        False,
        ["global"] * 4 + ["local"],
    ),
}


def _ids():
    return torch.randint(0, HF_SHAPE["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))


def _assert_logits_equal(logits, expected, what):
    difference = (logits - expected).abs().max().item()
    print(f"{what}: max |logits difference| {difference:.3g}")
    assert difference < 1e-10


def _saved_hf_model(case, path, random_hf_model):
    config_class, fields, keeps_layer_types, _ = CASES[case]
    hf_model = random_hf_model(config_class(**{**HF_SHAPE, "num_hidden_layers": 5, **fields}))
    hf_model.save_pretrained(path)
    if not keeps_layer_types:
        written = json.loads((path / "config.json").read_text())
        del written["layer_types"]
        (path / "config.json").write_text(json.dumps(written))
    return hf_model


@pytest.mark.parametrize("case", CASES)
def test_from_hf_and_to_hf_give_transformers_logits(case, tmp_path, random_hf_model):
    hf_model = _saved_hf_model(case, tmp_path / "source", random_hf_model)
    layer_types = hf_model.config.layer_types
    assert S in layer_types and F in layer_types
    model, config = from_hf(tmp_path / "source", dtype=torch.float64)
    assert config.decoder.pattern == CASES[case][3]
    masks = {S: SlidingWindowMaskConfig(window=5), F: CausalMaskConfig()}
    assert [layer.attention.mask for layer in config.decoder.layer_configs()] == [masks[t] for t in layer_types]
    expected = hf_model(input_ids=_ids()).logits
    _assert_logits_equal(model(CausalLMInput(input_ids=_ids())).logits, expected, f"{case}: from_hf")

    to_hf(model, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["layer_types"] == layer_types
    assert (written["use_sliding_window"], written["sliding_window"]) == (True, 5)
    if "max_window_layers" in CASES[case][1]:  # an older transformers, reading no layer_types, runs the same
        older = {key: value for key, value in written.items() if key != "layer_types"}
        assert transformers.AutoConfig.for_model(**older).layer_types == layer_types
    else:
        assert "max_window_layers" not in written  # no value of it gives this list
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
    assert type(reloaded) is type(hf_model) and reloaded.config.layer_types == layer_types
    _assert_logits_equal(reloaded(input_ids=_ids()).logits, expected, f"{case}: to_hf, then transformers")


def _config(model_type, **fields):
    return config_from_hf({**HF_SHAPE, "model_type": model_type, "num_hidden_layers": 5, **fields})


def test_a_uniform_list_stays_a_uniform_decoder():
    sliding = _config("qwen2", layer_types=[S] * 5, **WINDOW)
    assert sliding.decoder.pattern == [] and sliding.decoder.layer.attention.mask == SlidingWindowMaskConfig(5)
    assert family_of("qwen2").config_to_hf(sliding)["max_window_layers"] == 0
    full = _config("qwen3", max_window_layers=28, **WINDOW)  # the window unused: no layer reaches 28
    assert full.decoder.pattern == [] and full.decoder.layer.attention.mask == CausalMaskConfig()
    written = family_of("qwen3").config_to_hf(full)
    assert (written["use_sliding_window"], written["layer_types"], written["max_window_layers"]) == (False, [F] * 5, 5)


def test_qwen3_moe_slides_every_layer_whatever_layer_types_says():
    """transformers' Qwen3-MoE reads neither ``max_window_layers`` nor ``layer_types``."""
    config = _config("qwen3_moe", layer_types=[F, S, F, S, F], max_window_layers=3, **WINDOW)
    assert config.decoder.pattern == [] and config.decoder.layer.attention.mask == SlidingWindowMaskConfig(5)


@pytest.mark.parametrize(
    ("model_type", "fields", "message"),
    [
        ("qwen2", {"layer_types": [F, S, F, S, F]}, "has sliding_attention layers but no window"),
        ("qwen3", {"layer_types": [F, S, F, S, F], "use_sliding_window": True, "sliding_window": None}, "no window"),
        ("qwen2", {"layer_types": [F, S], **WINDOW}, "one of ['sliding_attention', 'full_attention'] for each of"),
        ("qwen3", {"layer_types": [F, S, F, S, "chunked_attention"], **WINDOW}, "chunked_attention"),
        ("mistral", {"layer_types": [F, S, F, S, F]}, "mixing full_attention and sliding_attention"),
        # gpt-oss alternates windows too, but its attention has learned sinks, which axtorch's has not.
        ("gpt_oss", {"layer_types": [S, F, S, F, S]}, "model_type='gpt_oss' is not supported"),
    ],
)
def test_from_hf_refuses_what_transformers_would_not_run_as_written(model_type, fields, message, tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**HF_SHAPE, "model_type": model_type, "num_hidden_layers": 5, **fields})
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf(tmp_path)


def _with_local_theta(config):
    config.decoder.variants["local"]["attention"]["position"] = {"theta": 100.0}


def _with_two_windows(config):
    config.decoder.variants["global"] = {"attention": {"mask": SlidingWindowMaskConfig(window=7)}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_with_local_theta, "layers that differ in more than their attention mask"),
        (_with_two_windows, "sliding windows of several sizes [5, 7]"),
    ],
)
def test_to_hf_refuses_layers_that_layer_types_cannot_say(change, message):
    config = _config("qwen3", layer_types=[S, S, F, S, S], **WINDOW)
    family_of("qwen3").config_to_hf(config)  # as imported, it can
    change(config)
    with pytest.raises(CannotExpress, match=re.escape(f"Qwen3ForCausalLM cannot express this model: {message}")):
        family_of("qwen3").config_to_hf(config)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_gguf_export_refuses_a_window_llama_cpp_would_not_apply(model_type, tmp_path):
    """llama.cpp's qwen2 and qwen3 (and transformers' GGUF loader) attend to the whole context in every layer."""
    with torch.device("meta"):
        model = _config(model_type, max_window_layers=2, **WINDOW).build()
    with pytest.raises(ValueError, match=rf"GGUF export: llama\.cpp's {model_type} cannot express a sliding window"):
        to_gguf(model, tokenizer=None, path=tmp_path / "model.gguf")  # refused before the tokenizer is read
    assert not any(tmp_path.iterdir())
