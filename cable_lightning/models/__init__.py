"""Backbones: config presets, the factory, and the attention backends."""

from .backbone import Backbone, KVCache, build_backbone
from .config import PRESETS, BackboneConfig

__all__ = ["Backbone", "BackboneConfig", "KVCache", "PRESETS", "build_backbone"]
