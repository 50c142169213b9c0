"""Meta-device construction, streamed initialisation and ``materialize``: no process holds the whole model."""

import weakref

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.interop.pretrained import Pretrained
from axtorch.layers.init import initial_parameter_values
from axtorch.parallel.backend import materialize
from axtorch.parallel.single import SingleDeviceBackend
from axtorch.train.trainer import build_parallel_model


def _config():
    return load_experiment_config(["experiment=debug"])


def _initialised_in_place(config) -> torch.nn.Module:
    """The reference: a whole model on the CPU whose modules each run ``reset_parameters`` on
    their own live parameters, in module order: plain torch, no twins, no streaming, no backend."""
    model = config.model.build()
    torch.manual_seed(config.trainer.seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters") and any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    return model


def test_streamed_initial_values_of_a_meta_model_equal_a_whole_model_initialised_in_place():
    config = _config()
    whole = _initialised_in_place(config)
    with torch.device("meta"):
        meta = config.model.build()
    torch.manual_seed(config.trainer.seed)
    streamed = dict(initial_parameter_values(meta))
    assert list(streamed) == [name for name, _ in whole.named_parameters()]
    for name, param in whole.named_parameters():
        assert torch.equal(streamed[name], param), name
    assert all(p.is_meta for p in meta.parameters())  # the source model was never materialised


def test_the_trainers_build_equals_a_whole_model_initialised_in_place():
    config = _config()
    reference = _initialised_in_place(config)
    built = build_parallel_model(config, SingleDeviceBackend(torch.device("cpu")))
    assert [n for n, _ in built.named_parameters()] == [n for n, _ in reference.named_parameters()]
    for (name, expected), (_, actual) in zip(reference.named_parameters(), built.named_parameters()):
        assert torch.equal(expected, actual), name
    assert not torch.equal(reference.embedding.weight, torch.zeros_like(reference.embedding.weight))


def test_materialize_names_parameters_left_without_a_value_and_values_without_a_parameter():
    config = _config()
    backend = SingleDeviceBackend(torch.device("cpu"))
    with torch.device("meta"):
        model = backend.parallelize(config.model.build())
    values = list(initial_parameter_values(model))
    with pytest.raises(RuntimeError, match=r"no value for parameters \['embedding.weight'\]"):
        materialize(backend, model, values[1:])
    with pytest.raises(KeyError, match=r"decoder\.layers\.99"):
        materialize(backend, model, [("decoder.layers.99.attention.q_proj.weight", values[0][1])])
    with pytest.raises(ValueError, match="shape"):
        materialize(backend, model, [("embedding.weight", torch.zeros(3, 3))])


def test_an_import_is_released_parameter_by_parameter_as_the_run_copies_it(tmp_path):
    """The imported model and the run's are never both whole: each imported tensor is freed once copied."""
    config = _config()
    imported = _initialised_in_place(config)
    expected = {name: value.clone() for name, value in imported.state_dict().items()}
    pretrained = Pretrained(imported, config.model, tmp_path / "tokenizer.json")
    handed_out = []
    for name, value in pretrained.release_parameters():
        assert all(previous() is None for previous in handed_out), f"a value before {name} is still held"
        assert name not in dict(imported.named_parameters())
        handed_out.append(weakref.ref(value))
        del value
    assert len(handed_out) == len(expected) and not list(imported.parameters())

    source = _initialised_in_place(config)
    built = build_parallel_model(
        config, SingleDeviceBackend(torch.device("cpu")), Pretrained(source, config.model, tmp_path)
    )
    for name, value in built.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert not list(source.parameters())
