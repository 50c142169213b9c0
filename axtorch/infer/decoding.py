"""Batched autoregressive generation with the training modules and a preallocated KV cache.

Prompts of different lengths share one batch, right-padded: the cache stores every token at its
own position, and the causal mask lets a position see only earlier ones, so a row never attends
to its padding (a row's first decoded tokens overwrite those slots before any query reaches
them). Each decode step is one forward of ``[B, 1]`` tokens with per-row positions on the device;
nothing in it reads the device, so shapes stay static and GPU work queues ahead. The host looks at
the tokens only every ``sync_every`` steps, to stop rows (end of sequence, stop strings) and to
stream text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, Union, cast

import torch

from axtorch.infer.cpu_weights import DecodeKernel, can_pack, decode_weights, kernel_refusal
from axtorch.infer.sampling import SamplingConfig, apply_penalties, sample_next_token
from axtorch.models.causal_lm import CausalLM, CausalLMInput

#: A chat message: ``{"role": "user", "content": "..."}``.
Message = Mapping[str, str]
#: A prompt as text, as token ids, or (``chat=True``) as a conversation.
Prompt = Union[str, Sequence[int], Sequence[Message]]


class Tokenizer(Protocol):
    """What generation needs of a tokenizer (``axtorch.data.tokenizer.Tokenizer`` has it)."""

    @property
    def eos_id(self) -> int: ...

    #: The token a text starts with (the model's tokenizer adds it), or None.
    bos_id: Optional[int]
    #: The ids that end a reply: EOS and the model's end-of-turn tokens.
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> str: ...


def prompt_text(tokenizer: Tokenizer, prompt: Union[str, Sequence[Message]]) -> str:
    """A chat prompt as ``generate(chat=True)`` reads it: a text is one user turn, rendered with the
    conversation through the tokenizer's chat template, the assistant's turn opened."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    return tokenizer.chat_prompt(messages)


def _prompt_ids(tokenizer: Tokenizer, prompt: Prompt, chat: bool) -> list[int]:
    if chat:
        if not isinstance(prompt, str) and not all(isinstance(message, Mapping) for message in prompt):
            raise ValueError("with chat=True a prompt is a user message (str) or a list of {role, content} messages")
        return tokenizer.encode(prompt_text(tokenizer, cast(Union[str, Sequence[Message]], prompt)))
    if isinstance(prompt, str):
        return ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(prompt)
    if not all(isinstance(token, int) for token in prompt):
        raise ValueError("a list of messages is a prompt only with chat=True")
    return list(cast(Sequence[int], prompt))


@dataclass
class Generation:
    """One prompt's continuation (the prompt itself excluded)."""

    text: str
    token_ids: list[int]
    #: "eos" (a stop token id), "stop" (a stop string), or "length" (``max_new_tokens`` reached).
    finish_reason: str


@dataclass
class TokenChunk:
    """Tokens decoded since the previous chunk, per row, and which rows have met a stop token."""

    tokens: list[list[int]]
    stopped: list[bool]


@torch.no_grad()
def decode_tokens(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    *,
    stop_token_ids: Sequence[int] = (),
    seeds: Optional[Sequence[int]] = None,
    sync_every: int = 8,
    compile: bool = False,
    step_boundary: Optional[Callable[[], None]] = None,
    pack: bool = True,
    kernel: Optional[DecodeKernel] = None,
) -> Generator[TokenChunk, None, None]:
    """Decode every prompt at once; yield the new tokens every ``sync_every`` steps and at the end.

    Rows go on decoding after their stop token (their later tokens are to be ignored) until the
    consumer stops iterating or ``max_new_tokens`` is reached. Row ``b`` samples from a generator
    seeded with ``seeds[b]`` (default: its index), so its tokens do not depend on the other rows.
    ``compile`` runs the decode step through ``torch.compile`` (static shapes: the cache's length
    rounded up to ``COMPILED_CACHE_MULTIPLE``, so it compiles once per batch size and length bucket;
    on CUDA with CUDA graphs, on a CPU with inductor's C++ wrapper); the prefill stays eager.
    ``step_boundary`` is called after the prefill and after each decode step: on XLA it is
    ``torch_xla.sync``, which cuts the lazy graph there, so that every decode step is the same
    fixed-shape program, compiled once (``axtorch.parallel.xla.decode_device``).
    ``pack`` decodes float32 weights on a CPU in decode formats (``cpu_weights.decode_weights``):
    q/k/v and gate/up each one stacked matrix, multiplied by ``kernel`` (None: the rule's,
    ``default_kernel``: axtorch's own where it compiled here, else torch's linear); the same math
    up to summation order, and the same tokens on every run.
    The model's own modules are put back when decoding ends. ``pack=False`` keeps the model's
    modules as they are; elsewhere it changes nothing. With ``compile`` the stacks use torch's
    linear (``DecodeKernel.linear``: inductor cannot lower the other kernels' weights), and another
    ``kernel`` is refused.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    if max_new_tokens < 1 or sync_every < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) and sync_every ({sync_every}) must be positive")
    if refusal := kernel_refusal(kernel, compile):
        raise ValueError(refusal)
    lengths = [len(p) for p in prompts]
    total = max(lengths) + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"the longest prompt ({max(lengths)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"model.max_seq_len={model.config.max_seq_len}"
        )
    parameter = next(model.parameters())
    device, batch, vocab = parameter.device, len(prompts), model.config.vocab_size
    if sampling.temperature > 0 and device.type == "xla":
        raise ValueError("on XLA decode greedily (temperature=0): per-row seeded sampling needs torch.Generator")
    seeds = list(range(batch)) if seeds is None else list(seeds)
    if len(seeds) != batch:
        raise ValueError(f"{len(seeds)} seeds for {batch} prompts")
    was_training = model.training
    model.eval()
    unpack = contextlib.ExitStack()
    try:
        if pack and can_pack(model):
            unpack.enter_context(decode_weights(model, DecodeKernel.linear if compile else kernel))
        # The prompts are written in one call, then one token per call: sliding-window layers keep rings.
        slots = compiled_cache_length(total, model.config.max_seq_len) if compile else total
        caches = model.allocate_kv_caches(batch, slots, dtype=parameter.dtype, device=device, max_write=max(lengths))
        ids = torch.zeros(batch, max(lengths), dtype=torch.long)
        seen = torch.zeros(batch, vocab, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.as_tensor(prompt)
            seen[row, torch.as_tensor(prompt)] = True
        ids, seen = ids.to(device), seen.to(device)
        next_position = torch.tensor(lengths, device=device)[:, None]
        prefill = CausalLMInput(input_ids=ids, kv_caches=caches, head_positions=next_position - 1)
        logits = model(prefill).logits[:, -1]
        if step_boundary is not None:
            step_boundary()
        generated_counts = torch.zeros(batch, vocab, device=device)
        stop_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        generators = None
        if sampling.temperature > 0:
            generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        decode_step = model
        if compile:
            decode_step = _compiled(model, device)
        pending: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            if sampling.penalised:
                logits = apply_penalties(logits, sampling, seen, generated_counts)
            token = sample_next_token(logits, sampling, generators)
            stopped |= torch.isin(token, stop_ids)
            pending.append(token)
            last = step + 1 == max_new_tokens
            if last or len(pending) == sync_every:
                yield TokenChunk(torch.stack(pending, dim=1).tolist(), stopped.tolist())  # the host reads here
                pending = []
            if last:
                break
            if sampling.penalised:
                generated_counts.scatter_add_(1, token[:, None], torch.ones_like(generated_counts[:, :1]))
                seen.scatter_(1, token[:, None], True)
            step_input = CausalLMInput(input_ids=token[:, None], positions=next_position, kv_caches=caches)
            with _guards_checked(compile, first=step == 0):
                logits = decode_step(step_input).logits[:, -1]
            next_position = next_position + 1
            if step_boundary is not None:
                step_boundary()
    finally:
        unpack.close()
        model.train(was_training)


#: Under ``compile`` the KV cache's length is rounded up to a multiple of this: the decode step's
#: shapes, and so its compiled program, then serve every call whose prompt and new tokens fit.
COMPILED_CACHE_MULTIPLE = 256


def compiled_cache_length(total: int, max_seq_len: int) -> int:
    """``total`` rounded up to ``COMPILED_CACHE_MULTIPLE``, at most ``max_seq_len``: slots past a
    row's position hold future positions, so the causal mask hides them and the tokens are the same."""
    return min(-(-total // COMPILED_CACHE_MULTIPLE) * COMPILED_CACHE_MULTIPLE, max_seq_len)


def _compiled(model: CausalLM, device: torch.device) -> CausalLM:
    """The decode step through ``torch.compile``: on CUDA with CUDA graphs; on a CPU with inductor's
    C++ wrapper, which calls the step's kernels from generated C++ rather than Python (a batch-1
    step is mostly small kernels besides the weight products; ``docs/benchmarks.md``)."""
    if device.type == "cuda":
        return cast(CausalLM, torch.compile(model, dynamic=False, mode="reduce-overhead"))
    if device.type == "cpu":
        return cast(CausalLM, torch.compile(model, dynamic=False, options={"cpp_wrapper": True}))
    return cast(CausalLM, torch.compile(model, dynamic=False))


def _guards_checked(compiled: bool, first: bool) -> contextlib.AbstractContextManager:
    """Which of the compiled step's guards run: all at a call's first step (a changed model or
    shape recompiles); at later steps, which give the same step inputs of the same kinds, only
    those that tell cached programs apart. Checking the guards on every parameter and cache took
    about 1.5 ms a step, 3% of a batch-1 step of SmolLM2-135M on a CPU."""
    if compiled and not first:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def generate_ids(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Optional[SamplingConfig] = None,
    *,
    stop_token_ids: Sequence[int] = (),
    seeds: Optional[Sequence[int]] = None,
    compile: bool = False,
    step_boundary: Optional[Callable[[], None]] = None,
    pack: bool = True,
    kernel: Optional[DecodeKernel] = None,
) -> list[list[int]]:
    """Each prompt's new token ids, up to (not including) its first stop token; no tokenizer needed."""
    rows: list[list[int]] = [[] for _ in prompts]
    sampling = sampling or SamplingConfig()
    chunks = decode_tokens(
        model,
        prompts,
        max_new_tokens,
        sampling,
        stop_token_ids=stop_token_ids,
        seeds=seeds,
        compile=compile,
        step_boundary=step_boundary,
        pack=pack,
        kernel=kernel,
    )
    for chunk in chunks:
        for row, new in zip(rows, chunk.tokens):
            row.extend(new)
        if all(chunk.stopped):
            break
    stops = set(stop_token_ids)
    return [row[: next((i for i, token in enumerate(row) if token in stops), len(row))] for row in rows]


class _Row:
    """The host's view of one row: its tokens and text so far, and why it ended."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.streamed = 0
        self.finish_reason: Optional[str] = None


def generate(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    sampling: Optional[SamplingConfig] = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    seeds: Optional[Sequence[int]] = None,
    stream: Optional[Callable[[int, str], None]] = None,
    sync_every: int = 8,
    compile: bool = False,
    step_boundary: Optional[Callable[[], None]] = None,
    pack: bool = True,
    kernel: Optional[DecodeKernel] = None,
    chat: bool = False,
) -> list[Generation]:
    """Continue every prompt (text or token ids) in one batch; each row stops on its own.

    A text prompt starts with the tokenizer's BOS when the model's tokenizer adds one (Gemma's
    ``<bos>``); token ids are taken as they are. ``chat=True`` answers each prompt as the model's
    assistant: a text is one user turn, a list of ``{"role", "content"}`` messages a conversation,
    rendered through the tokenizer's own chat template with the assistant's turn opened
    (``prompt_text``; transformers' ``apply_chat_template(add_generation_prompt=True)``), which
    puts in any BOS itself. A row ends at one of the tokenizer's ``stop_ids`` (its EOS and the
    model's end-of-turn tokens, e.g. Gemma's ``<end_of_turn>``) or ``stop_token_ids`` (not
    included), at the first of the ``stop`` strings (the text is cut before it), or after
    ``max_new_tokens``. ``stream(row, text)`` receives each row's new text as it is decoded,
    holding back what could still turn out to be the start of a stop string. ``pack`` (on by
    default) and ``kernel`` are ``decode_tokens``'s: on a CPU, float32 weights decode in their
    decode formats, with the rule's kernel or the one named.
    """
    sampling = sampling or SamplingConfig()
    encoded = [_prompt_ids(tokenizer, prompt, chat) for prompt in prompts]
    stop_ids = {*tokenizer.stop_ids, *stop_token_ids}
    rows = [_Row() for _ in encoded]
    chunks = decode_tokens(
        model,
        encoded,
        max_new_tokens,
        sampling,
        stop_token_ids=sorted(stop_ids),
        seeds=seeds,
        sync_every=sync_every,
        compile=compile,
        step_boundary=step_boundary,
        pack=pack,
        kernel=kernel,
    )
    for chunk in chunks:
        for index, (row, new) in enumerate(zip(rows, chunk.tokens)):
            if row.finish_reason is None:
                _extend(row, new, stop_ids, tokenizer, stop)
                if stream is not None:
                    _stream(index, row, stop, stream)
        if all(row.finish_reason is not None for row in rows):
            chunks.close()
            break
    for index, row in enumerate(rows):
        if row.finish_reason is None:
            row.finish_reason = "length"
            if stream is not None:
                _stream(index, row, stop, stream)  # what was held back
    return [Generation(row.text, row.ids, str(row.finish_reason)) for row in rows]


def _extend(row: _Row, new: list[int], stop_ids: set[int], tokenizer: Tokenizer, stop: Sequence[str]) -> None:
    for token in new:
        if token in stop_ids:
            row.finish_reason = "eos"
            break
        row.ids.append(token)
    row.text = tokenizer.decode(row.ids)
    found = [i for i in (row.text.find(s) for s in stop) if i >= 0]
    if found:
        cut = min(found)
        row.text = row.text[:cut]
        row.finish_reason = "stop"
        while len(row.ids) > 1 and len(tokenizer.decode(row.ids[:-1])) >= cut:  # drop tokens past the cut
            row.ids.pop()


def _stream(index: int, row: _Row, stop: Sequence[str], stream: Callable[[int, str], None]) -> None:
    ready = len(row.text)
    if row.finish_reason is None:
        ready -= max((len(s) - 1 for s in stop), default=0)  # a stop string may still be forming
        while ready > row.streamed and row.text[ready - 1] == "\ufffd":  # a character still missing bytes
            ready -= 1
    if ready > row.streamed:
        stream(index, row.text[row.streamed : ready])
        row.streamed = ready
