"""LightningModules and the optimisation recipe."""

from .modules import CausalLM, LanguageModel, MaskedLM
from .strategy import FSDP2Strategy

__all__ = ["CausalLM", "FSDP2Strategy", "LanguageModel", "MaskedLM"]
