"""axtorch's Hydra config groups, installed as the package ``axtorch.conf`` (see pyproject.toml)."""
