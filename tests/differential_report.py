"""What a conformance report's differential runs must show: the programs really ran
the calls the layer exists for (tests/test_conformance_honest.py, test_conformance_cli.py)."""

from __future__ import annotations

from polyengine.conformance.layer_differential import PROGRAMS, SHAPE_MODELS
from polyengine.conformance.models import ALL_MODEL_NAMES

# A pytest -k expression that keeps the suite's runs on the shape models (MHA, GQA, odd
# sizes) and leaves out the further architectures' models and the quantized ones: for runs
# that check what the architectures and weight formats do not change (honest variants of the reference, the Ray engine over
# the same tpu_jax engine), where the single-process runs of every backend already
# cover every architecture it declares and the quantized model (test_conformance_cli.py, test_neuron_conformance.py).
SHAPE_MODELS_ONLY = " and ".join(f"not {m}" for m in ALL_MODEL_NAMES if m not in SHAPE_MODELS)
SHAPE_CONFIGURATIONS = len([p for p in PROGRAMS if p.split("-")[0] in SHAPE_MODELS])

# What every configuration's programs must have done on an engine that declares token
# masks, and what the programs of all configurations together must have done.
_MASKS_EACH = ("prefill masks", "generate masks", "masks beside overrides", "masks excluding the unmasked pick",
               "tokens checked against their mask", "mask refusals compared")
_MASKS_ALL = ("prefill masks continuing a prefix", "bulk_insert samples under the prefix's mask")


def _model_of(test_id: str) -> str:
    """The model of a differential configuration's test id: ``test_differential[mha_tied-buckets]`` -> mha_tied."""
    return test_id.split("[")[1].split("-")[0].rstrip("]")


def assert_programs_exercised(tests, *, token_masks: bool = False, configurations: int = len(PROGRAMS),
                              prefill_lane: bool = False, mixed_step: int = 0) -> None:
    """Every differential configuration's programs compared tokens and refusals, and used
    prefixes the way the two prefix rules allow: after later prefills, and again after
    an insert (docs/design.md, Prefixes); with ``token_masks`` declared, they also drew
    masks on every path and refused bad ones; with ``prefill_lane``, they prefilled on
    the lane (every other prefill); with ``mixed_step``, every shape model's programs ran
    generate_with_prefill (where the engine's step takes the model's prompt rows in: the
    cpu engine's fused step)."""
    layer = [t for t in tests if t["id"].startswith("test_differential")]
    assert len(layer) == configurations, sorted(t["id"] for t in layer)
    # a configuration of an architecture the backend does not declare is skipped (test_architecture refuses it)
    skipped = [t for t in layer if t["status"] == "skipped"]
    assert all("is not declared (Capabilities.architectures" in t.get("reason", "") for t in skipped), skipped
    runs = {t["id"]: t.get("statistics", {}).get("programs", {}) for t in layer if t["status"] != "skipped"}
    assert runs, "no differential configuration ran"
    each = ("tokens compared", "refusals compared", "prefixes inserted after later prefills",
            "prefixes inserted after an insert", "results read after the next step")
    for test_id, counts in runs.items():
        if _model_of(test_id) not in SHAPE_MODELS:
            # a further architecture's model runs a few programs (ARCHITECTURE_EXAMPLES): they compare tokens
            assert counts.get("tokens compared", 0) > 0, f"{test_id}: no tokens compared: {counts}"
            continue
        for what in each + (_MASKS_EACH if token_masks else ()):
            assert counts.get(what, 0) > 0, f"{test_id}: no {what} in its programs: {counts}"
    for what in _MASKS_ALL if token_masks else ():
        assert sum(c.get(what, 0) for c in runs.values()) > 0, f"no {what} in any configuration's programs"
    if prefill_lane:
        assert all(c.get("prefills on the lane", 0) > 0 for c in runs.values()), f"no prefill on the lane: {runs}"
    if mixed_step:
        shapes = {i: c for i, c in runs.items() if _model_of(i) in SHAPE_MODELS}
        assert all(c.get("mixed steps", 0) > 0 for c in shapes.values()), f"no mixed step: {shapes}"
