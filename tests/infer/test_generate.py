import subprocess
import sys

import pytest
import torch

from axtorch.compose.experiment import load_experiment_config
from axtorch.infer.generate import generate
from axtorch.infer.sampling import SamplingConfig, sample_next_token
from axtorch.models import CausalLMInput
from axtorch.train.trainer import Trainer, build_model


def test_greedy_generation_with_cache_equals_repeated_full_forward():
    config = load_experiment_config(["experiment=debug"])
    model = build_model(config, torch.device("cpu")).eval()
    prompt = [5, 17, 3, 99]
    generated = generate(model, prompt, 12, SamplingConfig())
    ids = list(prompt)
    for _ in range(12):
        logits = model(CausalLMInput(input_ids=torch.tensor([ids]))).logits
        ids.append(int(logits[0, -1].argmax()))
    assert generated == ids[len(prompt) :]


def test_top_k_sampling_only_draws_from_the_k_best():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    generator = torch.Generator().manual_seed(0)
    draws = {int(sample_next_token(logits, SamplingConfig(temperature=2.0, top_k=2), generator)) for _ in range(200)}
    assert draws == {1, 2}


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    draws = {int(sample_next_token(logits, SamplingConfig(temperature=1.0, top_p=0.7), generator)) for _ in range(300)}
    assert draws == {0, 1}


def test_generation_refuses_to_run_past_the_model_length():
    model = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu"))
    with pytest.raises(ValueError, match="max_seq_len=256"):
        generate(model, [1] * 250, 10, SamplingConfig())


def test_generate_command_continues_a_prompt_from_a_trained_run(tmp_path, data_cache):
    config = load_experiment_config(
        [
            "experiment=debug",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={data_cache}",
            "trainer.max_steps=4",
            "trainer.progress_bar=false",
        ]
    )
    Trainer(config).fit()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "axtorch.generate",
            f"checkpoint={tmp_path / 'run'}",
            "prompt=import os",
            "max_new_tokens=8",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.startswith("import os") and len(result.stdout.rstrip("\n")) > len("import os")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "axtorch.generate",
            f"checkpoint={tmp_path / 'run'}",
            "prompt=x",
            "sampling.temprature=1",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "did you mean sampling.temperature" in bad.stderr
