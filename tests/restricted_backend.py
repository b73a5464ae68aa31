"""A correct backend that declares less than the reference: the suite's "undeclared"
branches must pass on it (refusals tested, not skipped).

It is the reference engine in float32 that declares no bulk_insert, no portable
prefixes, no prefix reuse, no penalties or min_p, at most 4 top log-probs and only the
Llama family (Capabilities' default architectures), and refuses each of the others with
UnsupportedFeature before any work.

Self-contained on purpose (it imports only polyengine): tests/test_conformance_thirdparty.py
copies this file into a throwaway third-party package as its engine module.
"""

from __future__ import annotations

from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.engine import Capabilities, EngineConfig
from polyengine.errors import UnsupportedFeature
from polyengine.models import Model
from polyengine.sampling.params import ENGINE_FIELDS

UNDECLARED = frozenset({"repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"})


class RestrictedEngine(ReferenceEngine):
    name = "restricted"

    def __init__(self, model: Model, config: EngineConfig):
        if config.dtype not in (None, "float32"):
            raise UnsupportedFeature(f"dtype {config.dtype!r}", self.name, "this backend computes in float32 only")
        if model.config.model_type not in ("llama", "qwen2"):
            raise UnsupportedFeature(f"architecture {model.config.model_type!r}", self.name, "it runs the Llama family")
        super().__init__(model, config.model_copy(update={"dtype": "float32"}))
        self.capabilities = Capabilities(
            dtypes=("float32",),
            sampling_params=ENGINE_FIELDS - UNDECLARED,
            max_top_logprobs=4,
        )

    def bulk_insert(self, prefix, decode_state, slots):
        raise UnsupportedFeature("bulk_insert", self.name)

    def export_prefix(self, prefix):
        raise UnsupportedFeature("export_prefix (portable prefixes)", self.name)

    def import_prefix(self, portable):
        raise UnsupportedFeature("import_prefix (portable prefixes)", self.name)


def create_engine(*, model: Model, config: EngineConfig) -> RestrictedEngine:
    return RestrictedEngine(model, config)
