"""Model FLOPs per token and model FLOPs utilisation (MFU), with a measured peak for machines whose peak is unknown."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Optional, cast

import torch
from torch import nn

from axtorch.layers.transformer import TransformerLayer
from axtorch.models.causal_lm import CausalLM, CausalLMConfig


def active_parameters(module: nn.Module) -> int:
    """Parameters that one token's forward pass multiplies with, in ``module`` and its children.

    All of a module's parameters are active unless it says otherwise through an
    ``active_parameter_count()`` method, which counts its whole subtree: a mixture of experts
    counts only the ``top_k`` of its ``num_experts`` routed experts that each token uses. The
    method is looked up by name so that FLOPs counting names no layer.
    """
    count = getattr(module, "active_parameter_count", None)
    if callable(count):
        return count()
    own = sum(p.numel() for p in module.parameters(recurse=False))
    return own + sum(active_parameters(child) for child in module.children())


#: A causal LM's tables that are looked up, not multiplied: the token and absolute-position embeddings.
LOOKUP_TABLES = ("embedding.weight", "position_embedding.weight")


def active_non_embedding_parameters(model: nn.Module) -> int:
    """``active_parameters`` of a causal LM less its ``LOOKUP_TABLES``.

    This is what ``transformer_flops_per_token`` takes as ``num_params_non_embedding``.
    """
    tables = sum(p.numel() for name, p in model.named_parameters() if name in LOOKUP_TABLES)
    return active_parameters(model) - tables


def transformer_flops_per_token(
    num_params_non_embedding: int,
    num_layers: int,
    dim: int,
    seq_len: int,
    vocab_size: int,
    tied: bool,
    attended_keys: Optional[Sequence[int]] = None,
) -> float:
    """Training FLOPs (forward + backward) per token of a decoder-only transformer.

    Follows the PaLM paper, appendix B: ``6 * N + 12 * num_layers * dim * seq_len``, where ``N``
    counts the weights of every matmul including the output head, and the second term is the
    attention scores and weighted values over the full ``seq_len`` (causal masking is not
    discounted, so numbers compare with published MFU figures). ``attended_keys``, one entry per
    layer, replaces ``seq_len`` layer by layer (``12 * dim * sum(attended_keys)``): a
    sliding-window layer scores only its window (``attended_keys_per_layer``).

    ``num_params_non_embedding`` is every parameter a token uses except the input token-embedding
    table and a learned position table (``active_non_embedding_parameters``: a mixture of experts
    counts only the experts each token is routed to, so ``N`` is the active, not the total,
    parameter count). A tied output head shares the token table, so its ``vocab_size * dim``
    weights are added here; an untied head is already in the count. Norm gains and biases are
    counted as if they were matmul weights, an overcount well under 0.1% for models of interest.
    """
    for name, value in (
        ("num_params_non_embedding", num_params_non_embedding),
        ("num_layers", num_layers),
        ("dim", dim),
        ("seq_len", seq_len),
        ("vocab_size", vocab_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    keys = [seq_len] * num_layers if attended_keys is None else list(attended_keys)
    if len(keys) != num_layers or min(keys) <= 0:
        raise ValueError(f"attended_keys must be {num_layers} positive counts, one per layer, got {keys}")
    matmul_params = num_params_non_embedding + (vocab_size * dim if tied else 0)
    return float(6 * matmul_params + 12 * dim * sum(keys))


def attended_keys_per_layer(decoder: nn.Module, seq_len: int) -> list[int]:
    """Keys each layer's queries score in a ``seq_len`` sequence, causality not discounted:
    ``seq_len``, or a shorter sliding window (the layer's ``attention.mask.window``)."""
    return [_attended_keys(layer, seq_len) for layer in cast(Iterable[TransformerLayer], decoder.layers)]


def _attended_keys(layer: TransformerLayer, seq_len: int) -> int:
    return min(seq_len, layer.attention.mask.window or seq_len)


def layer_flops_per_token(config: CausalLMConfig, seq_len: int) -> list[int]:
    """Each decoder layer's share of ``transformer_flops_per_token``: ``6 x`` its active weights
    ``+ 12 x dim x`` the keys it scores in a ``seq_len`` sequence.

    What pipeline stages balance: in a heterogeneous stack a global layer at a long ``seq_len``
    costs several sliding-window ones, and a mixture-of-experts layer more than a dense one
    (its routed experts, as ``active_parameters`` counts them). Each distinct layer config is
    built once, on the meta device.
    """
    layer_configs = config.decoder.layer_configs()  # a variant's layers share one config object
    costs: dict[int, int] = {}
    for layer_config in layer_configs:
        if id(layer_config) not in costs:
            with torch.device("meta"):
                layer = layer_config.build(config.dim)
            costs[id(layer_config)] = 6 * active_parameters(layer) + 12 * config.dim * _attended_keys(layer, seq_len)
    return [costs[id(layer_config)] for layer_config in layer_configs]


def model_flops_per_token(config: CausalLMConfig, seq_len: int, network: Optional[nn.Module] = None) -> float:
    """``transformer_flops_per_token`` of the whole model ``config`` describes, summed layer by
    layer (a stack's sliding-window layers score fewer keys than its global ones).

    Counted on ``network`` (that model, built) or on a copy built on the meta device: a process
    whose model is a part of it (pipeline stages) still reports the whole model's FLOPs.
    """
    if network is None:
        with torch.device("meta"):
            network = config.build()
    return transformer_flops_per_token(
        active_non_embedding_parameters(network),
        config.decoder.num_layers,
        config.dim,
        seq_len,
        config.vocab_size,
        config.tie_embeddings,
        attended_keys_per_layer(cast(CausalLM, network).decoder, seq_len),
    )


#: The peak measurement's first matmul side, and the time one matmul (or one timed group) should take.
_FIRST_SIDE = 256
_LONG_ENOUGH_S = 0.02


def measure_matmul_peak_flops(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    size: int = 2048,
    seconds: float = 0.25,
) -> float:
    """Achieved FLOP/s of a square matmul on ``device``: the MFU denominator where no datasheet peak applies.

    The matmul grows from 256 (or ``size``, if smaller) by doubling up to ``size`` while one takes
    under 20 ms: large enough to run at the peak, small enough that a dtype the device has no units
    for (bf16 on most CPUs, ~100x slower than fp32) is measured in about a second, not minutes.
    The best of at least two timings (each of enough matmuls to take ~20 ms) over ``seconds``,
    after a warm-up: a peak, so the fastest sample, which another process's burst on a shared core
    slows least. On a CPU a sample is also timed by the process's CPU time over its threads: while
    other processes hold the cores for the whole measurement, the wall clock runs on but the CPU
    time does not, so the peak stays the cores' own (as long as the matmul runs on every thread,
    as one of this size does; other busy threads of this process only lower it, toward the wall
    clock's figure). It measures under the current settings (CPU threads,
    ``torch.backends.cuda.matmul.allow_tf32``), which are the settings training runs under. Only
    CPU and CUDA are supported: timing a lazy device such as XLA needs its own graph execution,
    and such chips have known peaks.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"measuring the matmul peak on device type {device.type!r} is not supported (cpu, cuda); "
            "pass the chip's datasheet peak FLOP/s instead"
        )
    if size <= 0 or seconds <= 0:
        raise ValueError(f"size and seconds must be positive, got size={size}, seconds={seconds}")
    # Its own generator: measuring mid-run must not move the global RNG that dropout and data use,
    # or a resumed run would diverge from an uninterrupted one.
    generator = torch.Generator(device=device).manual_seed(0)
    side = min(size, _FIRST_SIDE)
    while True:
        a = torch.randn(side, side, device=device, dtype=dtype, generator=generator)
        b = torch.randn(side, side, device=device, dtype=dtype, generator=generator)
        out = torch.empty_like(a)
        _seconds_per_matmul(a, b, out, 1)  # library initialisation and kernel selection, not timed
        if side == size or _seconds_per_matmul(a, b, out, 1) >= _LONG_ENOUGH_S:
            break
        side = min(size, 2 * side)
    started = time.perf_counter()
    samples = [_seconds_per_matmul(a, b, out, 1)]
    group = max(1, math.ceil(_LONG_ENOUGH_S / max(samples[0], 1e-9)))  # a GPU's sync and the timer stay small beside it
    while len(samples) < 2 or time.perf_counter() - started < seconds:
        samples.append(_seconds_per_matmul(a, b, out, group))
    return 2 * side**3 / min(samples)


def _seconds_per_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, iterations: int) -> float:
    """Seconds per ``a @ b``; on a CPU the lesser of the wall clock and the CPU time over the threads."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        torch.matmul(a, b, out=out)
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
        return (time.perf_counter() - start) / iterations
    return min(time.perf_counter() - start, (time.process_time() - cpu_start) / torch.get_num_threads()) / iterations


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the fraction of ``peak_flops`` (FLOP/s) that the model's training FLOPs use.

    ``tokens_per_s`` and ``peak_flops`` must cover the same devices: both per device, or both summed.
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_s * flops_per_token / peak_flops
