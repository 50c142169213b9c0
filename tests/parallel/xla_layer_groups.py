"""Under torch_xla: a heterogeneous stack scanned one pattern period at a time (``LayerScan``)
gives the logits and gradients of running its layers one by one. Writes a JSON report to argv[1]."""

import json
import sys

import torch
import torch_xla

from axtorch.compose.experiment_loader import load_experiment_config
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


def logits_and_gradients(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(CausalLMInput(tokens)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch_xla.sync()
    return logits.cpu(), {name: p.grad.cpu() for name, p in model.named_parameters()}


def main(out: str) -> None:
    config = load_experiment_config(OVERRIDES)
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu")).to(torch_xla.device())
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1)).to(torch_xla.device())
    unrolled_logits, unrolled_grads = logits_and_gradients(model, tokens)
    scan = LayerScan()
    fill_seams(model, LayerRunner, scan)
    scanned_logits, scanned_grads = logits_and_gradients(model, tokens)
    fill_seams(model, LayerRunner, run_layers_unrolled)
    names = {id(p): name for name, p in model.named_parameters()}
    report = {
        "logits_max_diff": (scanned_logits - unrolled_logits).abs().max().item(),
        "grads_max_diff": max((scanned_grads[n] - unrolled_grads[n]).abs().max().item() for n in unrolled_grads),
        "grads_max": max(g.abs().max().item() for g in unrolled_grads.values()),
        "stacked_names": sorted({name for _, name in scan.stacks[0]}),
        "scanned_layers": sorted({int(names[id(p)].split(".")[2]) for p in scan.slots}),
        "groups": sorted({index for _, _, index in scan.slots.values()}),
    }
    with open(out, "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main(sys.argv[1])
