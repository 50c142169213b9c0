"""The decoder's layer-runner seam: every forward goes through it, KV-cache decoding too, and
decoding runs without remat."""

import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.layers.seams import fill_seams
from axtorch.layers.transformer import LayerRunner, run_layers_unrolled
from axtorch.models.causal_lm import CausalLMInput
from axtorch.train.trainer import build_model


def test_training_and_decoding_forwards_both_go_through_the_runner_and_only_training_remats():
    config = load_experiment_config(["experiment=debug", "model/remat=full"])
    model = build_model(config, torch.device("cpu"))
    calls = []

    def recording_runner(decoder, inputs):
        calls.append("decode" if inputs.kv_caches is not None else "full")
        return run_layers_unrolled(decoder, inputs)

    assert fill_seams(model, LayerRunner, recording_runner) == 1
    remats = []
    model.decoder.remat.register_forward_pre_hook(lambda module, args: remats.append(1))
    tokens = torch.randint(0, config.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    full = model(CausalLMInput(tokens)).logits
    assert calls == ["full"] and len(remats) == config.model.decoder.num_layers

    caches = model.allocate_kv_caches(2, 8, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        prefill = model(CausalLMInput(tokens[:, :7], kv_caches=caches)).logits
        step = model(CausalLMInput(tokens[:, 7:], positions=torch.full((2, 1), 7), kv_caches=caches)).logits
    assert calls == ["full", "decode", "decode"]
    assert len(remats) == config.model.decoder.num_layers  # a decode step keeps nothing for a backward
    torch.testing.assert_close(torch.cat([prefill, step], dim=1), full.detach(), atol=2e-5, rtol=1e-4)
