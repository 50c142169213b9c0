"""Run under the xla venv by ``test_xla_decode.py``: decode on the XLA device, report tokens and compilations.

PJRT_DEVICE=CPU python tests/infer/xla_decode_worker.py OUT_JSON
"""

import json
import sys

import torch
import torch_xla.debug.metrics as metrics

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.infer.decoding import generate_ids
from axtorch.parallel.xla import decode_device
from axtorch.train.trainer import build_model

PROMPTS = [[5, 17, 3, 99, 4, 8, 21], [7], [42, 43, 44, 45]]


def _compilations() -> int:
    return metrics.metric_data("CompileTime")[0]


def main() -> None:
    torch.manual_seed(0)
    model = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu")).eval()
    report: dict = {"cpu": generate_ids(model, PROMPTS, 24)}
    device, step_boundary = decode_device()
    model = model.to(device)
    report["xla"] = generate_ids(model, PROMPTS, 24, step_boundary=step_boundary)
    # Programs compiled per decode, by its length: a new length is a new cache shape.
    report["compilations"] = []
    for new_tokens in (40, 56, 40):
        before = _compilations()
        report[f"xla_{new_tokens}"] = generate_ids(model, PROMPTS, new_tokens, step_boundary=step_boundary)
        report["compilations"].append(_compilations() - before)
    with open(sys.argv[1], "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
