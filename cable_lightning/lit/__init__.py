"""LightningModules and the optimisation recipe."""

from .modules import CausalLM, LanguageModel, MaskedLM

__all__ = ["CausalLM", "LanguageModel", "MaskedLM"]
