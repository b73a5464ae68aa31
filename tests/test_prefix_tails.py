"""Portable prefix tails: ``PortablePrefix.start``/``tail``/``joined``, page keys, and
``import_prefix_tail`` (the kit's copy, the paged engines' sharing).

The format first (a tail's bytes round trip, version-1 data without ``start`` reads as
a whole prefix, a tail's bad start or K/V length and a tail given to plain
``import_prefix`` are InvalidRequest), then the page keys (chained: equal exactly as
far as two prompts' full pages agree, and only under the same model), then the
suite's checks (conformance/tails.py) on the reference, contiguous and paged, and on
paged engines that break them: one that copies the head instead of sharing its pages,
one that leaks pages when it refuses. Tiny models: a few seconds in all.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import warnings

import numpy as np
import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.kit import EngineBase
from polyengine.models import load_model
from polyengine.pages import PageList, common_pages, page_keys
from polyengine.prefix import PortablePrefix
from polyengine.protocol import Capabilities, protocol_problems

from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.conformance.tails import (head_of, tail_import_problems, tail_refusal_problems, tail_sharing_problems,
                                          tail_starts)


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


@pytest.fixture(scope="module")
def other():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny")


CFG = EngineConfig(max_slots=3, max_prefill_length=60, max_cache_length=96)
PROMPT = [3 + (7 * i) % 50 for i in range(14)]


def _whole(model, prompt=PROMPT, seed=5) -> PortablePrefix:
    ref = ReferenceEngine(model, CFG)
    prefix, _ = ref.prefill(params=ref.load_params(), tokens=prompt, sampling=SamplingParams(temperature=0.8, seed=seed))
    return ref.export_prefix(prefix)


# -- the format ------------------------------------------------------------------------------


def test_a_tail_round_trips_through_bytes_and_joins_back_to_the_whole(tiny):
    whole = _whole(tiny)
    tail = PortablePrefix.from_bytes(whole.tail(8).to_bytes())
    assert tail.start == 8 and tail.is_tail and tail.k.shape[2] == 6 and tail.prompt_tokens.tolist() == PROMPT
    assert np.array_equal(tail.k, whole.k[:, :, 8:]) and np.array_equal(tail.last_logits, whole.last_logits)
    again = tail.joined(whole.k[:, :, :8], whole.v[:, :, :8])
    assert again.start == 0 and np.array_equal(again.k, whole.k) and np.array_equal(again.v, whole.v)
    assert whole.tail(8).tail(11).start == 11 and np.array_equal(whole.tail(8).tail(11).k, whole.k[:, :, 11:])
    assert whole.tail(14).k.shape[2] == 0  # an empty tail: ids and logits only
    with pytest.raises(InvalidRequest, match="head for a tail from position 8"):
        tail.joined(whole.k[:, :, :7], whole.v[:, :, :7])


def test_version_1_data_without_start_reads_as_a_whole_prefix(tiny):
    """Bytes a writer before tails made (no ``start`` in the metadata) still read."""
    from safetensors.numpy import save

    whole = _whole(tiny)
    meta = {"format": "polyengine.prefix", "version": "1", "model_fingerprint": whole.model_fingerprint,
            "sampling": whole.sampling.model_dump_json()}
    old = save({"k": whole.k, "v": whole.v, "prompt_tokens": whole.prompt_tokens, "last_logits": whole.last_logits},
               metadata=meta)
    read = PortablePrefix.from_bytes(old)
    assert read.start == 0 and read.version == 1 and np.array_equal(read.k, whole.k)
    assert json.loads(old[8: 8 + int.from_bytes(old[:8], "little")])["__metadata__"].get("start") is None


@pytest.mark.parametrize(("start", "cut", "match"), [
    (-1, 0, "start must be an integer position in 0..14"), (15, 0, "start must be an integer position in 0..14"),
    (True, 1, "start must be an integer"), (4, 0, "needs 10"), (4, 5, "needs 10"), ("2", 2, "start must be"),
])
def test_a_bad_start_or_tail_length_is_refused(tiny, start, cut, match):
    whole = _whole(tiny)
    with pytest.raises(InvalidRequest, match=match):
        PortablePrefix(k=whole.k[:, :, cut:], v=whole.v[:, :, cut:], prompt_tokens=whole.prompt_tokens,
                       last_logits=whole.last_logits, sampling=whole.sampling,
                       model_fingerprint=whole.model_fingerprint, start=start)
    with pytest.raises(InvalidRequest, match="a tail of this prefix starts at a position in 0..14"):
        whole.tail(15)


def test_a_tail_from_bytes_with_a_bad_start_is_refused(tiny):
    whole = _whole(tiny)
    data = bytearray(whole.tail(4).to_bytes())
    at = data.index(b'"start":"4"')
    data[at: at + 11] = b'"start":"9"'  # same length: the K/V hold 10 positions, a tail from 9 needs 5
    with pytest.raises(InvalidRequest, match="needs 5"):
        PortablePrefix.from_bytes(bytes(data))
    data[at: at + 11] = b'"start":"x"'
    with pytest.raises(InvalidRequest, match="metadata is malformed"):
        PortablePrefix.from_bytes(bytes(data))


def test_plain_import_refuses_a_tail_and_check_compatible_sees_changed_fields(tiny):
    eng = ReferenceEngine(tiny, CFG)
    whole = _whole(tiny)
    with pytest.raises(InvalidRequest, match="import it with import_prefix_tail"):
        eng.import_prefix(whole.tail(4))
    broken = whole.tail(4)
    broken.start = 3  # changed after construction: the K/V no longer fit
    with pytest.raises(InvalidRequest, match="from position 3"):
        eng.import_prefix_tail(broken, existing_prefix=eng.import_prefix(whole))


# -- page keys -------------------------------------------------------------------------------


def test_page_keys_agree_exactly_as_far_as_full_pages_do():
    a = list(range(40))
    b = a[:20] + [99] + a[21:]
    ka, kb = page_keys(a, 8, fingerprint="m"), page_keys(b, 8, fingerprint="m")
    assert len(ka) == 5 and len(page_keys(a[:39], 8, fingerprint="m")) == 4  # a partly filled page has no key
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))  # chained: differs from page 2 on
    assert common_pages(ka, kb) == 2 and common_pages(ka, ka[:3]) == 3
    assert page_keys(a, 8, fingerprint="other") != ka and page_keys(a, 4, fingerprint="m")[:1] != ka[:1]
    assert page_keys(a[8:16] + a[:8] + a[16:], 8, fingerprint="m")[1] != ka[1]  # a page's key covers all before it
    with pytest.raises(InvalidRequest, match="page_size"):
        page_keys(a, 0, fingerprint="m")
    with pytest.raises(InvalidRequest, match="int32"):
        page_keys([2 ** 31] * 8, 8, fingerprint="m")


def test_a_portable_prefix_gives_its_prompts_page_keys(tiny):
    whole = _whole(tiny)
    assert whole.page_keys(4) == page_keys(PROMPT, 4, fingerprint=tiny.fingerprint)
    assert whole.tail(8).page_keys(4) == whole.page_keys(4)  # the ids are the whole prompt's
    assert common_pages(whole.page_keys(4), _whole(tiny, PROMPT[:9] + [1] * 5).page_keys(4)) == 2


# -- import_prefix_tail -------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"page_size": 4}, {"page_size": 16}])
def test_the_suites_tail_checks_pass_on_the_reference(tiny, other, options):
    eng = ReferenceEngine(tiny, CFG.model_copy(update={"options": options}))
    params, whole = eng.load_params(), _whole(tiny)
    assert tail_import_problems(eng, params, whole, tail_starts(14, options.get("page_size", 0))) == []
    foreign_eng = ReferenceEngine(other, CFG.model_copy(update={"options": options}))
    foreign, _ = foreign_eng.prefill(params=foreign_eng.load_params(), tokens=PROMPT, sampling=whole.sampling)
    assert tail_refusal_problems(eng, params, whole, foreign) == []
    if options.get("page_size") == 4:
        assert tail_sharing_problems(eng, params, whole) == []


def test_a_tail_continues_like_the_whole_prefix(tiny):
    """The prefix a tail import gives is a prefix like any: continued, truncated and
    exported as the whole prefix imported is (paged, on a head the engine prefilled; in
    float32, so the head's export is exact and the two prefixes hold the same K/V)."""
    eng = ReferenceEngine(tiny, CFG.model_copy(update={"options": {"page_size": 4}, "dtype": "float32"}))
    params, whole = eng.load_params(), _whole(tiny)
    head, _ = eng.prefill(params=params, tokens=PROMPT[:10], sampling=whole.sampling)
    joined = whole.tail(8).joined(eng.export_prefix(head).k[:, :, :8], eng.export_prefix(head).v[:, :, :8])
    got, want = eng.import_prefix_tail(whole.tail(8), existing_prefix=head), eng.import_prefix(joined)
    more = SamplingParams(temperature=0, max_tokens=4)
    a, _ = eng.prefill(params=params, tokens=[5, 6, 7], sampling=more, existing_prefix=got)
    b, _ = eng.prefill(params=params, tokens=[5, 6, 7], sampling=more, existing_prefix=want)
    assert np.array_equal(a.logits, b.logits) and a.first_token == b.first_token
    cut = eng.truncate_prefix(params=params, prefix=got, length=11)
    assert np.array_equal(cut.logits, eng.truncate_prefix(params=params, prefix=want, length=11).logits)


def test_import_prefix_tail_is_capability_guarded_and_optional(tiny):
    eng = ReferenceEngine(tiny, CFG)
    eng.capabilities = eng.capabilities.model_copy(update={"portable_prefix_tail": False})
    whole = _whole(tiny)
    with pytest.raises(UnsupportedFeature, match="import_prefix_tail"):
        eng.import_prefix_tail(whole.tail(4), existing_prefix=eng.import_prefix(whole))
    with pytest.raises(ValueError, match="portable_prefix_tail needs portable_prefix"):
        Capabilities(dtypes=("float32",), portable_prefix_tail=True)

    class Older(EngineBase):  # a third-party engine written before tails: no method, no capability
        name = "older"
        import_prefix_tail = None

    problems = protocol_problems(Older)
    assert not any("import_prefix_tail" in p for p in problems), problems


# -- broken paged engines: the suite's checks catch them --------------------------------------


class CopiesHead(ReferenceEngine):
    """Imports a tail the kit's way on a paged engine: the head exported and imported
    into new pages, never shared."""

    _import_tail = EngineBase._import_tail


class LeaksOnRefusal(ReferenceEngine):
    """Forks the head's pages before checking it, and keeps them when it refuses."""

    kept: list = []

    def import_prefix_tail(self, portable, *, existing_prefix):
        if self.pages:
            self.kept.append(existing_prefix.kv.fork(min(portable.start, existing_prefix.true_length)))
        return super().import_prefix_tail(portable, existing_prefix=existing_prefix)


@pytest.mark.parametrize(("engine_type", "check", "broken"), [
    (CopiesHead, "sharing", "must be shared, not copied"),
    (CopiesHead, "import", None),  # a copy is still the right prefix
    (LeaksOnRefusal, "refusals", "left"),
])
def test_the_tail_checks_catch_what_breaks_them(tiny, other, engine_type, check, broken):
    eng = engine_type(tiny, CFG.model_copy(update={"options": {"page_size": 4}}))
    params, whole = eng.load_params(), _whole(tiny)
    if check == "sharing":
        problems = tail_sharing_problems(eng, params, whole)
    elif check == "import":
        problems = tail_import_problems(eng, params, whole, tail_starts(14, 4))
    else:
        foreign_eng = ReferenceEngine(other, CFG.model_copy(update={"options": {"page_size": 4}}))
        foreign, _ = foreign_eng.prefill(params=foreign_eng.load_params(), tokens=PROMPT, sampling=whole.sampling)
        problems = tail_refusal_problems(eng, params, whole, foreign)
    if broken is None:
        assert problems == []
    else:
        assert any(broken in p for p in problems), problems
    LeaksOnRefusal.kept.clear()
    del eng
    gc.collect()


def test_a_refused_tail_holds_no_pages_and_changes_no_head(tiny):
    eng = ReferenceEngine(tiny, CFG.model_copy(update={"options": {"page_size": 4}}))
    params, whole = eng.load_params(), _whole(tiny)
    head, _ = eng.prefill(params=params, tokens=PROMPT[:6] + [1, 1, 1, 1], sampling=whole.sampling)
    held, seq = eng.pages.held, list(eng.prefix_pages(head).pages)
    with pytest.raises(InvalidRequest, match="differs from the portable prefix's head at token 6"):
        eng.import_prefix_tail(whole.tail(8), existing_prefix=head)
    with pytest.raises(InvalidRequest, match="holds only 10 positions"):
        eng.import_prefix_tail(whole.tail(12), existing_prefix=head)
    assert eng.pages.held == held and list(eng.prefix_pages(head).pages) == seq
    assert isinstance(eng.import_prefix_tail(whole.tail(4), existing_prefix=head).kv, PageList)


@pytest.mark.parametrize("options", [{"cpu_kernels": False}, {"cpu_kernels": False, "page_size": 4}])
def test_the_suites_tail_checks_pass_on_the_cpu_backend(tiny, other, options):
    """The torch engines' import (torch_common): the kit's copy on contiguous K/V, the
    head's pages shared with ``page_size`` (PagedKV.scatter from the tail's offset)."""
    from polyengine.backends.cpu.engine import CpuEngine

    cfg = CFG.model_copy(update={"options": options, "dtype": "float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cpu backend's fallback notice
        eng, foreign_eng = CpuEngine(tiny, cfg), CpuEngine(other, cfg)
    params, whole = eng.load_params(), _whole(tiny)
    assert tail_import_problems(eng, params, whole, tail_starts(14, options.get("page_size", 0))) == []
    foreign, _ = foreign_eng.prefill(params=foreign_eng.load_params(), tokens=PROMPT, sampling=whole.sampling)
    assert tail_refusal_problems(eng, params, whole, foreign) == []
    if "page_size" in options:
        assert tail_sharing_problems(eng, params, whole) == []


@pytest.mark.parametrize("backend", ["tpu_jax", "neuron"])
def test_the_suites_tail_checks_pass_on_the_paged_static_shape_engines(tiny, other, backend, request):
    """tpu_jax (PagedKV.write from the tail's start) and neuron on its CPU compile path
    (the torch_common scatter from the tail's offset) with ``page_size``: the held
    prefix's pages below the start shared, only the tail written, refusals holding nothing."""
    if backend == "tpu_jax":
        pytest.importorskip("jax")
        if importlib.util.find_spec("torchax") is None:  # not importorskip: torchax imports only through compat
            pytest.skip("torchax is not installed (pip install 'polyengine[tpu]')")
        request.getfixturevalue("jax_compile_less")
        from polyengine.backends.tpu_jax.engine import TpuJaxEngine as Engine
    else:
        pytest.importorskip("torch")
        from polyengine.backends.neuron.engine import NeuronEngine as Engine
    cfg = CFG.model_copy(update={"options": {"page_size": 4}, "dtype": "float32", "max_prefill_length": 16,
                                 "max_cache_length": 32})
    eng, foreign_eng = Engine(tiny, cfg), Engine(other, cfg)
    assert eng.capabilities.portable_prefix_tail and eng.capabilities.page_size == 4
    params, whole = eng.load_params(), _whole(tiny)
    assert tail_import_problems(eng, params, whole, tail_starts(14, 4)) == []
    foreign, _ = foreign_eng.prefill(params=foreign_eng.load_params(), tokens=PROMPT, sampling=whole.sampling)
    assert tail_refusal_problems(eng, params, whole, foreign) == []
    assert tail_sharing_problems(eng, params, whole) == []
