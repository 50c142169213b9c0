"""Under torch_xla: a heterogeneous stack scanned one pattern period at a time (``LayerScan``)
gives the logits and gradients of running its layers one by one, on rows of one document and on
rows that pack several (segment ids, positions restarting), and the packed rows' logits and
gradients equal one device's without torch_xla. Writes a JSON report to argv[1]."""

import copy
import json
import sys

import torch
import torch_xla

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.data.batches import to_batch
from axtorch.data.document_tokens import DOCUMENT_START
from axtorch.layers.seams import fill_seams
from axtorch.layers.transformer import LayerRunner, run_layers_unrolled
from axtorch.models.causal_lm import CausalLMInput
from axtorch.parallel.xla_scan import LayerScan
from axtorch.train.trainer import build_model

#: 7 layers of period 3 (local, local, global): two scanned groups, then one layer unrolled.
OVERRIDES = [
    "model=local_global_tiny",
    "model.decoder.num_layers=7",
    "model.decoder.variants.local.attention.mask.window=4",
    "model.vocab_size=256",
    "model.dim=64",
    "model.decoder.layer.attention.num_heads=4",
    "model.decoder.layer.feed_forward.hidden_dim=128",
]


#: Where the documents of two packed rows of 12 tokens start: 3 documents, then 2.
DOCUMENT_STARTS = [[0, 5, 9], [0, 7]]


def packed_rows(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ids and per-document positions of ``tokens`` packed at ``DOCUMENT_STARTS``, as the
    loader makes them (``to_batch`` of windows flagged with ``DOCUMENT_START``)."""
    windows = torch.cat([tokens, tokens[:, -1:]], dim=1)  # a window holds one more token, for the labels
    for row, starts in enumerate(DOCUMENT_STARTS):
        windows[row, starts] |= DOCUMENT_START
    batch = to_batch(windows.numpy(), document_masking=True)
    return batch["segment_ids"], batch["positions"]


def logits_and_gradients(model, tokens, segments=None, positions=None):
    model.zero_grad(set_to_none=True)
    logits = model(CausalLMInput(tokens, positions=positions, segment_ids=segments)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch_xla.sync()
    return logits.cpu(), {name: p.grad.cpu() for name, p in model.named_parameters()}


def max_differences(a, b) -> tuple[float, float]:
    """The largest absolute difference of two ``logits_and_gradients`` results: logits, gradients."""
    (logits_a, grads_a), (logits_b, grads_b) = a, b
    return (logits_a - logits_b).abs().max().item(), max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a)


def main(out: str) -> None:
    config = load_experiment_config(OVERRIDES)
    torch.manual_seed(0)
    one_device = build_model(config, torch.device("cpu"))
    model = copy.deepcopy(one_device).to(torch_xla.device())
    cpu_tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    tokens = cpu_tokens.to(torch_xla.device())
    segments, positions = packed_rows(cpu_tokens)
    packed_inputs = (tokens, segments.to(tokens.device), positions.to(tokens.device))
    one_device_packed = logits_and_gradients(one_device, cpu_tokens, segments, positions)
    unrolled_logits, unrolled_grads = logits_and_gradients(model, tokens)
    unrolled_packed = logits_and_gradients(model, *packed_inputs)
    scan = LayerScan()
    fill_seams(model, LayerRunner, scan)
    scanned_logits, scanned_grads = logits_and_gradients(model, tokens)
    stacks = list(scan.stacks)
    scanned_packed = logits_and_gradients(model, *packed_inputs)
    fill_seams(model, LayerRunner, run_layers_unrolled)
    names = {id(p): name for name, p in model.named_parameters()}
    report = {
        "logits_max_diff": (scanned_logits - unrolled_logits).abs().max().item(),
        "grads_max_diff": max((scanned_grads[n] - unrolled_grads[n]).abs().max().item() for n in unrolled_grads),
        "grads_max": max(g.abs().max().item() for g in unrolled_grads.values()),
        # Packed documents: scanned against unrolled, and against one device without torch_xla.
        "packed_vs_unrolled": max_differences(scanned_packed, unrolled_packed),
        "packed_vs_one_device": max_differences(scanned_packed, one_device_packed),
        "packed_grads_max": max(g.abs().max().item() for g in one_device_packed[1].values()),
        # How far masking the documents moves the logits (it must, or the check above is empty).
        "packing_changes_logits": (unrolled_packed[0] - unrolled_logits).abs().max().item(),
        "stacked_names": sorted({name for _, name in stacks[0]}),
        "scanned_layers": sorted({int(names[id(p)].split(".")[2]) for p in scan.slots}),
        "groups": sorted({index for _, _, index in scan.slots.values()}),
    }
    with open(out, "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main(sys.argv[1])
