"""Document masking (``data.document_masking=true``) gives the same training losses on one device,
under the native backend (FSDP over 2 gloo processes; and with each sequence split over 2 more,
context parallelism gathering the keys' documents; and over 2 pipeline stages) and under the xla
backend (2 CPU devices, and 4 with each sequence split over 2, with the layers unrolled and scanned)."""

import json
import random
from pathlib import Path

import pytest
import torch
from debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from forked_ranks import run_ranks
from xla_runs import needs_xla, run_worker

NATIVE_WORKER = Path(__file__).with_name("native_worker.py")
MASKED = "data.document_masking=true"
WORDS = ["def", "return", "class", "import", "self", "value", "index", "alpha", "beta", "gamma"]

pytestmark = [pytest.mark.slow, pytest.mark.journey]


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache) -> tuple[Path, Path, list[str], list[float]]:
    """(root, data cache, the data overrides, one device's losses with document masking)."""
    root = tmp_path_factory.mktemp("document_masking")
    rng = random.Random(0)  # documents of 3 to 30 words: several in each row of 64 tokens
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(400)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    data = ("data=jsonl", f"data.source.paths=[{root / 'docs.jsonl'}]")
    cache = data_cache
    train_on_one_device(root / "single", cache, *data, MASKED)
    train_on_one_device(root / "unmasked", cache, *data)
    masked, unmasked = train_losses(root / "single"), train_losses(root / "unmasked")
    assert len(masked) == STEPS and max(abs(a - b) for a, b in zip(masked, unmasked)) > 1e-3  # masking is on
    return root, cache, [*data, MASKED], masked


def assert_same_losses(run_dir: Path, expected: list[float]) -> None:
    losses = train_losses(run_dir)
    print(f"{run_dir.name}: max |loss - one device's| = {max(abs(a - b) for a, b in zip(losses, expected)):.3g}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_native_fsdp2_matches_one_device(single):
    root, cache, data, expected = single
    overrides = debug_overrides(root / "native", cache, "backend=native", "mesh.fsdp=2", *data)
    run_ranks(2, str(NATIVE_WORKER), str(root / "native"), str(STEPS), *overrides)
    assert_same_losses(root / "native", expected)


def test_native_context_parallel_matches_one_device(single):
    root, cache, data, expected = single
    overrides = debug_overrides(root / "native_seq2", cache, "backend=native", "mesh.fsdp=2", "mesh.seq=2", *data)
    run_ranks(4, str(NATIVE_WORKER), str(root / "native_seq2"), str(STEPS), *overrides)
    assert_same_losses(root / "native_seq2", expected)


def test_native_pipeline_matches_one_device(single):
    """2 stages under 1F1B over 4 micro-batches: the stages take each micro-batch's segment ids and
    positions with its activations."""
    root, cache, data, expected = single
    overrides = debug_overrides(root / "pp2", cache, "backend=native", "mesh.pipe=2", *data)
    run_ranks(2, str(NATIVE_WORKER), str(root / "pp2"), str(STEPS), *overrides)
    assert_same_losses(root / "pp2", expected)


@needs_xla
@pytest.mark.parametrize(
    "name, devices, mesh",
    [
        ("xla_fsdp2", 2, ("mesh.fsdp=2",)),
        ("xla_fsdp2_seq2", 4, ("mesh.fsdp=2", "mesh.seq=2")),
        # The scanned layers take the segment ids in the scan's carry (and recompute with them).
        ("xla_fsdp2_seq2_scan", 4, ("mesh.fsdp=2", "mesh.seq=2", "execution.layer_runner=scan", "model/remat=full")),
    ],
)
def test_xla_matches_one_device(single, name, devices, mesh):
    root, cache, data, expected = single
    overrides = debug_overrides(root / name, cache, *mesh, "sharding=fsdp", *data)
    run_worker(devices, root / f"{name}.json", STEPS, overrides)
    assert_same_losses(root / name, expected)
