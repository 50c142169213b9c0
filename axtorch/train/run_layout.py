"""What a run directory holds, by name: the one place its layout is written down.

The trainer writes these, and ``load_trained_model``, ``axtorch-plot``, ``axtorch-ckpt`` and
``axtorch-generate`` read them; the README's run-directory paragraph describes each.
"""

#: The resolved experiment config: enough to rebuild the model (``axtorch.config.serialize``).
CONFIG_FILE = "config.yaml"
#: The tokenizer the run trained with.
TOKENIZER_FILE = "tokenizer.json"
#: One JSON object per logged step (``train.metrics.MetricsLogger``).
METRICS_FILE = "metrics.jsonl"
#: Wall time by category, one cumulative line per update (``train.goodput``).
GOODPUT_FILE = "goodput.jsonl"
#: The TensorBoard mirror of the metrics.
TENSORBOARD_DIR = "tensorboard"
#: ``step_<8 digits>/`` per saved step (``train.checkpoint``).
CHECKPOINTS_DIR = "checkpoints"
#: The loss curves, drawn at the end of a run and by ``axtorch-plot``.
LOSS_PLOT_FILE = "loss.png"
#: The wall-time breakdown ``axtorch-plot goodput=true`` draws.
GOODPUT_PLOT_FILE = "goodput.png"

#: What the trainer prints that a run directory holds.
SUMMARY = f"{CONFIG_FILE}, {METRICS_FILE}, {TENSORBOARD_DIR}/, {CHECKPOINTS_DIR}/, {LOSS_PLOT_FILE}"
