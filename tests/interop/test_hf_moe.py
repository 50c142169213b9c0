"""Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints <-> axtorch's mixture of experts: the same logits
in float64 at each hop.

Tiny HF models with random weights are saved in each layout transformers reads (the hub's
per-expert tensors, which ``save_pretrained`` writes by default, and transformers 5's fused
``gate_up_proj``), imported with ``from_hf``, exported with ``to_hf`` and reloaded by transformers.
"""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_shapes import HF_SHAPE

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.interop import from_hf, to_hf
from axtorch.interop.families import config_from_hf
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.mixture_of_experts import Gating, MixtureOfExpertsConfig
from axtorch.models.causal_lm import CausalLMInput

mixtral = transformers.models.mixtral.modeling_mixtral
qwen2_moe = transformers.models.qwen2_moe.modeling_qwen2_moe
qwen3_moe = transformers.models.qwen3_moe.modeling_qwen3_moe

SHAPE = {
    **HF_SHAPE,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}

#: case -> (config class, tie_word_embeddings, config fields beyond SHAPE, architecture to_hf writes)
CASES = {
    "mixtral": (transformers.MixtralConfig, False, dict(num_local_experts=4), "MixtralForCausalLM"),
    "mixtral-window-tied": (
        transformers.MixtralConfig,
        True,
        dict(num_local_experts=4, sliding_window=5),
        "MixtralForCausalLM",
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        False,
        dict(num_experts=4, moe_intermediate_size=24, head_dim=16, norm_topk_prob=False),
        "Qwen3MoeForCausalLM",
    ),
    # Routed experts plus a sigmoid-gated shared expert, biases on q/k/v only.
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        False,
        dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=False),
        "Qwen2MoeForCausalLM",
    ),
    # Qwen2-MoE slides on alternate layers before max_window_layers: layer 0 slides, layer 1 does not.
    "qwen2_moe-window": (
        transformers.Qwen2MoeConfig,
        False,
        dict(
            num_experts=4,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=2,
        ),
        "Qwen2MoeForCausalLM",
    ),
    "qwen3_moe-normalised-window": (
        transformers.Qwen3MoeConfig,
        True,
        dict(
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            use_sliding_window=True,
            sliding_window=5,
        ),
        "Qwen3MoeForCausalLM",
    ),
}


@pytest.fixture
def float64_hf_moe(monkeypatch):
    """HF computes RMSNorm and the router's softmax in float32 even for float64 inputs; make them float64."""

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def router(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        values, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
            values = values / values.sum(-1, keepdim=True)
        return logits, values, indices

    for module, prefix in ((mixtral, "Mixtral"), (qwen2_moe, "Qwen2Moe"), (qwen3_moe, "Qwen3Moe")):
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", rms_norm)
        monkeypatch.setattr(getattr(module, f"{prefix}TopKRouter"), "forward", router)


def _hf_model(case, **overrides):
    config_class, tie, fields, _ = CASES[case]
    config = config_class(**{**SHAPE, **fields, **overrides}, tie_word_embeddings=tie)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # the default grouped_mm has no float64 kernel
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():  # HF initialises norms to 1 and may start routers at 0: make every weight matter
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn_like(param))
    return model


def _ids():
    return torch.randint(0, SHAPE["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))


def _max_difference(ours, theirs):
    ids = _ids()
    return (ours(CausalLMInput(input_ids=ids)).logits - theirs(input_ids=ids).logits).abs().max().item()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("layout", "max_shard_size"), [("hub", "5GB"), ("hub", "20KB"), ("fused", "5GB")])
def test_from_hf_logits_equal_transformers(case, layout, max_shard_size, tmp_path, float64_hf_moe):
    hf_model = _hf_model(case)
    hf_model.save_pretrained(tmp_path, max_shard_size=max_shard_size, save_original_format=layout == "hub")
    names = {name for file in tmp_path.glob("*.safetensors") for name in _safetensors_names(file)}
    assert any(".experts.0." in name for name in names) == (layout == "hub")

    model, config = from_hf(tmp_path, dtype=torch.float64)

    feed_forward = config.decoder.layer.feed_forward
    assert type(feed_forward) is MixtureOfExpertsConfig and feed_forward.capacity_factor is None
    window = CASES[case][2].get("sliding_window")
    # Qwen2-MoE's layers each slide or not (layer_types); the others' all alike.
    types = getattr(hf_model.config, "layer_types", None) or ["sliding_attention" if window else None] * 2
    slides = [kind == "sliding_attention" for kind in types]
    masks = [layer.attention.mask for layer in config.decoder.layer_configs()]
    assert masks == [SlidingWindowMaskConfig(window) if slide else CausalMaskConfig() for slide in slides]
    difference = _max_difference(model, hf_model)
    print(f"{case} {layout} {max_shard_size}: max |logits difference| {difference:.3g}")
    assert difference < 1e-10


@pytest.mark.parametrize("case", CASES)
def test_to_hf_writes_hub_tensors_that_transformers_loads_with_the_same_logits(case, tmp_path, float64_hf_moe):
    hf_model = _hf_model(case)
    hf_model.save_pretrained(tmp_path / "source")
    model, _ = from_hf(tmp_path / "source", dtype=torch.float64)

    to_hf(model, tmp_path / "export", max_shard_bytes=40_000)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    architecture = CASES[case][3]
    assert written["architectures"] == [architecture]
    names = {name for file in (tmp_path / "export").glob("*.safetensors") for name in _safetensors_names(file)}
    source = {name for name in _safetensors_names(tmp_path / "source" / "model.safetensors")}
    assert names == source  # the hub layout, name for name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager"
    ).eval()

    assert type(reloaded).__name__ == architecture
    ids = _ids()
    difference = (reloaded(input_ids=ids).logits - hf_model(input_ids=ids).logits).abs().max().item()
    print(f"{case}: max |logits difference| after to_hf {difference:.3g}")
    assert difference < 1e-10


def _safetensors_names(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as file:
        return list(file.keys())


@pytest.mark.parametrize("num_layers", [1, 2])
def test_load_balancing_loss_is_hf_mixtral_loss_per_layer_summed(num_layers, tmp_path, float64_hf_moe):
    """axtorch's aux loss is one Switch/Mixtral loss per layer, summed, each weighted ``coef / num_layers``.

    HF's ``load_balancing_loss_func`` pools the router logits of all the layers it is given; applied
    to each layer's logits alone it is axtorch's per-layer loss. For one layer the two definitions
    coincide, and axtorch's aux loss is HF's ``router_aux_loss_coef * aux_loss``.
    """
    hf_model = _hf_model("mixtral", num_hidden_layers=num_layers, router_aux_loss_coef=0.02)
    hf_model.save_pretrained(tmp_path)
    model, config = from_hf(tmp_path, dtype=torch.float64)
    router = config.decoder.layer.feed_forward.router
    assert router.load_balancing_loss_weight == pytest.approx(0.02 / num_layers)
    assert router.z_loss_weight == 0.0

    ids = _ids()
    ours = model(CausalLMInput(input_ids=ids)).aux_loss
    hf_output = hf_model(input_ids=ids, output_router_logits=True)
    per_layer = [
        mixtral.load_balancing_loss_func((logits,), num_experts=4, top_k=2) for logits in hf_output.router_logits
    ]
    assert len(per_layer) == num_layers
    # HF accumulates its statistics in float32.
    assert ours.item() == pytest.approx(0.02 / num_layers * sum(loss.item() for loss in per_layer), rel=1e-6)
    if num_layers == 1:
        assert ours.item() == pytest.approx(0.02 * hf_output.aux_loss.item(), rel=1e-6)


def test_from_hf_maps_the_router_fields():
    mixtral_config = config_from_hf(
        {**SHAPE, "model_type": "mixtral", "num_local_experts": 8, "router_aux_loss_coef": 0.02}
    )
    feed_forward = mixtral_config.decoder.layer.feed_forward
    assert (feed_forward.num_experts, feed_forward.hidden_dim, feed_forward.router.top_k) == (8, 48, 2)
    assert feed_forward.router.normalize_top_k and feed_forward.router.gating is Gating.softmax
    assert mixtral_config.decoder.layer.attention.query_norm is None
    # transformers 5 writes num_local_experts for Qwen3-MoE too; the hub's files say num_experts.
    for experts_key in ("num_experts", "num_local_experts"):
        qwen = config_from_hf(
            {
                **SHAPE,
                "model_type": "qwen3_moe",
                experts_key: 16,
                "num_experts_per_tok": 4,
                "moe_intermediate_size": 24,
                "norm_topk_prob": False,
            }
        )
        feed_forward = qwen.decoder.layer.feed_forward
        assert (feed_forward.num_experts, feed_forward.hidden_dim, feed_forward.router.top_k) == (16, 24, 4)
        assert not feed_forward.router.normalize_top_k
        assert qwen.decoder.layer.attention.query_norm is not None
        assert qwen.decoder.layer.attention.resolved_head_dim(qwen.dim) == 8  # dim / heads, unlike Qwen3's 128


@pytest.mark.parametrize(
    ("model_type", "fields", "message"),
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
        ("deepseek_v3", {}, "model_type='deepseek_v3' is not supported"),
    ],
)
def test_from_hf_refuses_what_axtorch_cannot_represent(model_type, fields, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": model_type, **fields}))
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf(tmp_path)


def _tiny_moe_config(model_type="mixtral"):
    return config_from_hf({**SHAPE, "model_type": model_type, "num_local_experts": 4, "moe_intermediate_size": 24})


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("mixtral", lambda f: setattr(f.router, "gating", Gating.sigmoid), "sigmoid gating"),
        ("mixtral", lambda f: setattr(f, "capacity_factor", 1.25), "capacity_factor=1.25"),
        ("qwen3_moe", lambda f: setattr(f.router.projection, "bias", True), "a bias on the router"),
        ("mixtral", lambda f: setattr(f.router, "normalize_top_k", False), "not renormalised"),
    ],
)
def test_to_hf_refuses_what_mixtral_and_qwen3_moe_cannot_express(model_type, change, message, tmp_path):
    config = _tiny_moe_config(model_type)
    change(config.decoder.layer.feed_forward)
    with torch.device("meta"):
        model = config.build()
    with pytest.raises(ValueError, match=message):
        to_hf(model, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("preset", "architecture"), [("mixtral_tiny", "MixtralForCausalLM"), ("qwen3_moe_tiny", "Qwen3MoeForCausalLM")]
)
def test_tiny_presets_export_to_their_hf_family(preset, architecture, tmp_path, float64_hf_moe):
    config = load_experiment_config(
        [
            f"model={preset}",
            "model.vocab_size=97",
            "model.dim=32",
            "model.decoder.num_layers=2",
            "model.decoder.layer.attention.num_heads=4",
            "model.decoder.layer.feed_forward.hidden_dim=24",
        ]
    )
    torch.manual_seed(0)
    model = config.model.build().double().eval()
    model.init_weights()
    to_hf(model, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager"
    ).eval()
    assert type(reloaded).__name__ == architecture
    assert _max_difference(model, reloaded) < 1e-10
