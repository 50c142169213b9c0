"""data=chat renders conversations token for token as transformers' ``apply_chat_template`` does,
with SmolLM2's own template (from its GGUF) and a Llama-3-style one, and finds the assistant's
tokens: as ``return_assistant_tokens_mask`` does where the template marks ``{% generation %}``,
and by the assistant turns' spans where it does not."""

import json

import jinja2
import pytest
from test_gguf_smollm2 import smollm2_gguf  # noqa: F401 (the fixture)

from axtorch.data.chat_template import ChatTemplate
from axtorch.data.tokenizer import TOKENIZER_SETTINGS_FILE, Tokenizer
from axtorch.interop import from_gguf
from axtorch.interop.gguf import tokenizer_settings

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.journey]  # reads the SmolLM2 GGUF

#: Llama 3's template (BOS, header tokens, trimmed content, <|eot_id|>), its assistant output in a generation block.
LLAMA3_GENERATION = (
    "{{- bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3 = LLAMA3_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": " Bonjour ! "},
        {"role": "user", "content": "Thanks, see you."},
        {"role": "assistant", "content": "À bientôt."},
    ],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):  # noqa: F811
    """(our tokenizer with the GGUF's tokenizer_config.json, transformers' tokenizer from the same files)."""
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    _, _, tokenizer = from_gguf(smollm2_gguf)
    tokenizer.save(directory / "tokenizer.json")
    settings = tokenizer_settings(smollm2_gguf)
    (directory / TOKENIZER_SETTINGS_FILE).write_text(json.dumps(settings))
    ours = Tokenizer.load(directory / "tokenizer.json", tokenizer.eos_token)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        bos_token=settings["bos_token"],
        eos_token=settings["eos_token"],
    )
    return ours, reference


def reference_encoding(reference, template: str, messages, **options):
    return reference.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True, **options)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_smollm2s_own_template_token_for_token(smollm2, conversation):
    ours, reference = smollm2
    template = ChatTemplate.from_settings(ours.settings, "the GGUF")
    assert "<|im_start|>" in template.source and not template.marks_generation
    ids, targets = template.encode(conversation, ours)
    assert ids == reference_encoding(reference, template.source, conversation)["input_ids"]
    # By span: the trained-on tokens are exactly each assistant turn and its end of turn.
    replies = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert ours.decode([i for i, t in zip(ids, targets) if t]) == "".join(f"{r}<|im_end|>\n" for r in replies)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_llama3_template_matches_the_assistant_tokens_mask(smollm2, conversation):
    ours, reference = smollm2
    tagged = ChatTemplate(LLAMA3_GENERATION, {"bos_token": reference.bos_token, "eos_token": reference.eos_token})
    expected = reference_encoding(reference, LLAMA3_GENERATION, conversation, return_assistant_tokens_mask=True)
    ids, targets = tagged.encode(conversation, ours)
    assert ids == expected["input_ids"]
    assert targets.astype(int).tolist() == expected["assistant_masks"]
    if any(m["content"].strip() for m in conversation if m["role"] == "assistant"):
        assert targets.any()
    # Without the generation tags, rendering turn by turn finds the same tokens.
    untagged = ChatTemplate(LLAMA3, tagged.special_tokens)
    assert not untagged.marks_generation
    untagged_ids, untagged_targets = untagged.encode(conversation, ours)
    assert untagged_ids == ids and untagged_targets.tolist() == targets.tolist()


def test_the_templates_globals_are_transformers(smollm2):
    ours, reference = smollm2
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}" + LLAMA3
    template = ChatTemplate(strict, {"bos_token": reference.bos_token})
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        template.encode(CONVERSATIONS[1], ours)
    shown = ChatTemplate("{{ messages | tojson }}{{ eos_token }}", {"eos_token": "<|im_end|>"})
    text, _ = shown.render(CONVERSATIONS[1][:1])
    assert text == json.dumps(CONVERSATIONS[1][:1], ensure_ascii=False) + "<|im_end|>"


def test_a_template_whose_turns_change_later_is_refused(smollm2):
    ours, _ = smollm2
    # Marks the last message: an earlier render's last turn differs once more turns follow.
    marking = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match=r"\{% generation %\}"):
        ChatTemplate(marking, {}).encode(CONVERSATIONS[1], ours)
