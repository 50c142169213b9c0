"""Model assemblies built only from ``axtorch.layers``."""

from axtorch.models.causal_lm import CausalLM, CausalLMConfig, CausalLMInput, CausalLMOutput

__all__ = ["CausalLM", "CausalLMConfig", "CausalLMInput", "CausalLMOutput"]
