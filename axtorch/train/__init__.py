"""Training: the experiment schema, the trainer, the loss, and a trained run's model.

The names below are imported on first use (``axtorch.config.lazy_exports``), so a module that
needs one piece (``axtorch.train.flops``) does not pay for the whole trainer.
"""

from typing import TYPE_CHECKING

from axtorch.config.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from axtorch.train.config import Precision, TrainerConfig
    from axtorch.train.experiment import ExperimentConfig
    from axtorch.train.loss import CrossEntropyLoss, CrossEntropyLossConfig, LossInput, LossOutput, forward_with_loss
    from axtorch.train.optimizer import OptimConfig
    from axtorch.train.trained_model import load_trained_model
    from axtorch.train.trainer import Trainer, TrainResult, build_model

__all__ = [
    "CrossEntropyLoss",
    "CrossEntropyLossConfig",
    "ExperimentConfig",
    "LossInput",
    "LossOutput",
    "OptimConfig",
    "Precision",
    "TrainResult",
    "Trainer",
    "TrainerConfig",
    "build_model",
    "forward_with_loss",
    "load_trained_model",
]

__getattr__ = lazy_exports(__name__, __file__)
