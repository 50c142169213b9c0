# The two README commands: `make train` (set up, then run the main job) and `make test`
# (set up, then run the whole suite). Extra arguments go through ARGS, e.g.
# `make train ARGS="experiment=debug"` or `make test ARGS="-m 'not slow'"`.
PYTHON ?= python3
VENV := .venv
XLA_VENV := .venv-xla

.PHONY: train test

train: $(VENV)/.axtorch-base
	$(VENV)/bin/axtorch-train $(ARGS)

test: $(VENV)/.axtorch-test $(XLA_VENV)/.axtorch-xla
	$(VENV)/bin/python -m pytest $(ARGS)

# torch 2.13 (CPU build) for everything but the XLA backend.
$(VENV)/.axtorch-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install "torch==2.13.0" -e .
	touch $@

$(VENV)/.axtorch-test: $(VENV)/.axtorch-base
	$(VENV)/bin/pip install "torch==2.13.0" -e ".[test]"
	touch $@

# torch_xla 2.9 needs exactly torch 2.9.0: its own environment, used by tests/parallel/test_xla_backend.py.
$(XLA_VENV)/.axtorch-xla: pyproject.toml
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/pip install -e ".[xla]"
	touch $@
