"""Model I/O: configs, weights (safetensors, GGUF), tokenizer, chat template, presets.

Everything here is NumPy-only: no torch, jax or ray. The ``gguf`` package is imported
only when a GGUF file is read.

    >>> from polyengine.models import load_model
    >>> model = load_model()                 # the embedded SmolLM2-135M-Instruct
    >>> model = load_model("random:tiny")    # random weights, for tests
"""

from polyengine.models.chat import ChatTemplate, ChatTemplateError
from polyengine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from polyengine.models.loader import (
    InsufficientMemory,
    RandomWeightsWarning,
    available_memory,
    default_model_path,
    load_model,
)
from polyengine.models.model import Model
from polyengine.models.presets import list_presets, preset_config
from polyengine.models.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "Model",
    "ModelConfig",
    "RopeScaling",
    "SUPPORTED_ARCHITECTURES",
    "Tokenizer",
    "IncrementalDetokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "load_model",
    "list_presets",
    "preset_config",
    "default_model_path",
    "available_memory",
    "InsufficientMemory",
    "RandomWeightsWarning",
]
