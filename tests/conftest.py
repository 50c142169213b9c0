import pytest


@pytest.fixture
def data_cache(tmp_path_factory):
    """One tokenized-corpus cache shared by a test module's runs, isolated from the user's."""
    return tmp_path_factory.getbasetemp() / "data-cache"


@pytest.fixture
def float64_hf_rmsnorm(monkeypatch):
    """HF's RMSNorms compute in float32 even for float64 inputs; make the oracles float64 throughout."""
    transformers = pytest.importorskip("transformers")
    import torch

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def gemma_forward(self, hidden_states):  # Gemma's norms multiply by 1 + weight
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.eps)) * (1.0 + self.weight)

    models = transformers.models
    for norm in (
        models.llama.modeling_llama.LlamaRMSNorm,
        models.mistral.modeling_mistral.MistralRMSNorm,
        models.qwen2.modeling_qwen2.Qwen2RMSNorm,
        models.qwen3.modeling_qwen3.Qwen3RMSNorm,
    ):
        monkeypatch.setattr(norm, "forward", forward)
    for norm in (
        models.gemma.modeling_gemma.GemmaRMSNorm,
        models.gemma2.modeling_gemma2.Gemma2RMSNorm,
        models.gemma3.modeling_gemma3.Gemma3RMSNorm,
    ):
        monkeypatch.setattr(norm, "forward", gemma_forward)


@pytest.fixture
def random_hf_model():
    """Build a float64 HF model from a config, with norms and biases perturbed away from 1 and 0."""
    transformers = pytest.importorskip("transformers")
    import torch

    def build(config, attention="sdpa"):  # "eager" for models whose scores SDPA cannot soft-cap (Gemma 2)
        config._attn_implementation = attention
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
        with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb so they are tested
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.add_(0.1 * torch.randn_like(param))
        return model

    return build


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first, and every test in a scheduling group: its file's, unless it names its own.

    Under pytest-xdist (``make test``: a worker per core, ``--dist loadgroup``) each group runs
    whole on one worker, so a file's module fixtures run once; a file that can split (the
    documented commands, one group per document) names finer groups. The groups holding slow
    tests start early, and the many short files fill in at the end.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
