"""Model I/O: configs, weights (safetensors, GGUF), tokenizer, chat template, presets."""

from polyengine.models.config import ModelConfig, RopeScaling
from polyengine.models.model import Model

__all__ = ["Model", "ModelConfig", "RopeScaling"]
