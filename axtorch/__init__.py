"""axtorch: composable, config-driven LLM training in PyTorch."""

__version__ = "0.1.0"
