import os
from collections import Counter
from pathlib import Path

import pytest
from xdist_scheduling import scheduling_group

pytest_plugins = ["suite_timing", "tiers"]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker and the processes it starts get the worker's share of the cores.

    ``make test`` runs one worker per core. With torch's default (a thread per core) in every
    worker and every training subprocess, the cores are oversubscribed and each small op of a
    debug model waits for a time slice (~3 ms): a 30-step debug run took 21.4 s on 2 threads beside
    a busy worker, 8.5 s on 1. torchrun already gives its workers one thread; a user's
    ``OMP_NUM_THREADS`` wins.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))
    import torch

    torch.set_num_threads(int(threads))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenized-corpus cache for the whole run, isolated from the user's.

    Under pytest-xdist the workers share it too (their base directories sit side by side): the
    debug corpus is tokenized once, not once per worker and per multi-process set-up. Entries are
    written atomically, meta.json last, and tokenizing is deterministic, so a race between two
    writers leaves the same files.
    """
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "data-cache"


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` by scheduling_group, on the controller, which sees only node ids.

    pytest-xdist's own loadgroup reads ``xdist_group`` marks on the workers and passes the group
    on by renaming the item (``item._nodeid``), which pytest 9.2 no longer reads: every test then
    became its own unit, so two workers each ran a file's module fixture and a document's earlier
    commands. Groups start in collection order (``--no-loadscope-reorder``), set below.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The groups with the most slow tests first, each in its own order, so that the longest
    (a document's commands, a multi-process set-up) start at once and the many short files fill in
    at the end (the scheduler keeps this order: ``--no-loadscope-reorder``)."""
    marked = [item.nodeid for item in items if item.get_closest_marker("xdist_group") is not None]
    if marked:  # pytest 9.2 never lets xdist see them (pytest_xdist_make_scheduler above)
        raise pytest.UsageError(
            f"xdist_group marks are not read; name the group in tests/xdist_scheduling.py FINER_GROUPS: {marked[:3]}"
        )
    slow = Counter(scheduling_group(item.nodeid) for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[scheduling_group(item.nodeid)])
