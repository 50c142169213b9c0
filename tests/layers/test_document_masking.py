"""Document masking: packed documents attend only within themselves, with positions restarting in
each, so that a packed row gives every document the loss it has on its own."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.data.batches import IGNORED_LABEL, to_batch
from axtorch.data.document_tokens import mark_starts_after
from axtorch.layers.attention import AttentionInput
from axtorch.layers.attention_kernel import SdpaKernel
from axtorch.layers.attention_mask import CausalMaskConfig, DocumentMask, SlidingWindowMaskConfig
from axtorch.models.causal_lm import CausalLMInput
from axtorch.parallel.pipeline import STAGE_KEYWORDS, StageModule, keep_stages
from axtorch.parallel.pipeline_config import layer_ranges

EOS = 0
LENGTHS = (7, 12, 5, 9)  # EOS included: 33 tokens, one row of 32 inputs


def documents(vocab_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, vocab_size, (length,), generator=generator) for length in LENGTHS]
    for doc in docs:
        doc[-1] = EOS
    return docs


def packed_batch(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    window = torch.cat(docs).numpy()[None, :]
    return to_batch(mark_starts_after(window, EOS), document_masking=True)


def model_for(preset: str, *overrides: str) -> torch.nn.Module:
    config = load_experiment_config([f"model={preset}", *overrides]).model
    torch.manual_seed(0)
    model = config.build().double()
    model.init_weights()
    return model.eval()


def token_losses(model, ids, labels, **inputs) -> torch.Tensor:
    logits = model(CausalLMInput(ids, **inputs)).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORED_LABEL, reduction="none")


@pytest.mark.parametrize(
    "preset, overrides, tolerance",
    [
        ("llama_tiny", (), 1e-12),  # RoPE, causal
        ("mistral_tiny", ("model.decoder.layer.attention.mask.window=4",), 1e-12),  # a window within documents
        ("gpt2_tiny", (), 1e-12),  # learned absolute positions
        # A kernel that takes the mask as a tensor; its softmax runs in float32.
        ("llama_tiny", ("model/attention_kernel=softcapped",), 1e-6),
    ],
)
def test_four_packed_documents_lose_what_each_loses_alone(preset, overrides, tolerance):
    model = model_for(preset, *overrides)
    docs = documents(model.config.vocab_size)
    batch = packed_batch(docs)
    with torch.no_grad():
        packed = token_losses(
            model, batch["input_ids"], batch["labels"], positions=batch["positions"], segment_ids=batch["segment_ids"]
        )
        alone = [token_losses(model, doc[None, :-1], doc[None, 1:]) for doc in docs]
    starts = np.cumsum((0, *LENGTHS[:-1]))
    difference = 0.0
    for doc, start, own in zip(docs, starts, alone):
        # A document's labels are its own next tokens; its EOS predicts nothing (the next one's first).
        span = packed[start : start + len(doc) - 1]
        difference = max(difference, (span - own).abs().max().item(), abs(span.mean() - own.mean()).item())
        assert batch["labels"][0, start + len(doc) - 1 : start + len(doc)].tolist() in ([], [IGNORED_LABEL])
    print(f"{preset} {overrides}: max |packed - alone| per-token or per-document loss = {difference:.3g}")
    assert difference < tolerance
    with torch.no_grad():  # the same row without document masking: later documents see earlier ones
        run_on = token_losses(model, batch["input_ids"], batch["labels"])
    assert (run_on - packed).abs().max() > 1e-3


def test_positions_restart_and_segments_count_documents():
    batch = packed_batch(documents(50))
    starts = np.cumsum((0, *LENGTHS[:-1]))
    expected_positions = np.concatenate([np.arange(length) for length in LENGTHS])[:32]
    assert batch["positions"][0].tolist() == expected_positions.tolist()
    assert batch["segment_ids"][0].tolist() == np.repeat(np.arange(1, 5), LENGTHS)[:32].tolist()
    assert (batch["labels"][0, starts[1:] - 1] == IGNORED_LABEL).all()
    assert (batch["labels"] != IGNORED_LABEL).sum() == 32 - 3


def test_the_document_mask_is_the_configured_mask_within_each_document():
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    segments = torch.tensor([[1, 1, 1, 2, 2, 2, 2]])
    window = DocumentMask(SlidingWindowMaskConfig(window=2))
    allowed = window(positions, positions, segments, segments)[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ]
    causal = DocumentMask(CausalMaskConfig())
    assert causal.is_plain_causal
    assert torch.equal(causal(positions, positions), CausalMaskConfig().build()(positions, positions))


def test_unpacked_data_keeps_the_fused_causal_kernel(monkeypatch):
    model = model_for("llama_tiny")
    calls = []
    forward = SdpaKernel.forward

    def recording(self, q, k, v, *, mask, causal, scale, dropout_p):
        calls.append((mask is None, causal))
        return forward(self, q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p)

    monkeypatch.setattr(SdpaKernel, "forward", recording)
    batch = packed_batch(documents(model.config.vocab_size))
    with torch.no_grad():
        model(CausalLMInput(batch["input_ids"]))
        assert set(calls) == {(True, True)}  # no mask tensor: the kernel applies causality itself
        calls.clear()
        model(CausalLMInput(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"]))
    assert set(calls) == {(False, False)}


def test_decoding_refuses_segment_ids():
    model = model_for("llama_tiny")
    attention = model.decoder.layers[0].attention
    x = torch.randn(1, 4, model.config.dim, dtype=torch.float64)
    positions, segments = torch.arange(4)[None], torch.tensor([[1, 1, 2, 2]])
    cache = attention.allocate_kv_cache(1, 8, dtype=torch.float64, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="KV-cache decoding reads one document"):
        attention(AttentionInput(x, positions, cache, segments))


def test_pipeline_stages_take_the_segment_ids_and_positions_with_the_activations():
    """Stages chained as a pipeline runs them, each given the micro-batch's positions and segment
    ids, give the whole model's logits of a packed row (and not its unmasked ones)."""
    model = model_for("llama_tiny", "model.tie_embeddings=false", "model.decoder.num_layers=3")
    batch = packed_batch(documents(model.config.vocab_size))
    keywords = {key: batch[key] for key in STAGE_KEYWORDS}
    ranges = layer_ranges([1, 1, 1], 2, [2])
    hidden = batch["input_ids"]
    with torch.no_grad():
        for stage, layers in enumerate(ranges):
            part = keep_stages(model, ranges, [stage])
            hidden = StageModule(part, layers, first=stage == 0, last=stage == 1)(hidden, **keywords)
        whole = model(CausalLMInput(batch["input_ids"], **keywords)).logits
        unmasked = model(CausalLMInput(batch["input_ids"])).logits
    torch.testing.assert_close(hidden, whole, rtol=1e-12, atol=1e-12)
    assert (whole - unmasked).abs().max() > 1e-3
