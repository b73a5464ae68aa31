"""Layer 6, differential: random protocol programs, run on the backend and the reference.

The other layers check each rule at one configuration; this one explores the
protocol's state space. Hypothesis draws programs of protocol calls (see
:mod:`polyengine.conformance.programs` for what a program holds and what is compared),
runs each on the backend and on the reference, and compares every output. A failing
program is shrunk to a short one, which the failure message prints as code.

Configurations: each test model (those of undeclared architectures skipped; the quantized
ones included) in the standard engine, and the default model in the
two prefill-bucket variants, all in the backend's first declared dtype. The three shape
models (``mha_tied``, ``gqa_llama3``, ``odd_qwen2``: MHA, GQA, odd sizes) and the
bucket variants run ``EXAMPLES`` programs each; each further architecture's model runs
``ARCHITECTURE_EXAMPLES`` (its layers, not the protocol, are what differs, and the
numerics layer checks those at length), which keeps the layer's CI time near what it
was before the architectures came. These are the engines the other layers build already, so a
compiled backend compiles nothing new for this layer (its first use of a bucket the
other layers did not reach compiles once, never once per program). The programs share
one decode state, every slot freed between them (``ProgramRun.fresh_states``).

Budget and reproduction: ``EXAMPLES`` programs per configuration, seeded (``SEEDS``),
so a run is deterministic and a failure in CI reproduces by running the same test
again. ``--polyengine-differential-examples N`` runs more programs (also
``polyengine conformance --differential-examples N``); ``--polyengine-differential-seed``
draws other programs.
"""

from __future__ import annotations

import contextlib
import gc
import time

import pytest

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS, SEEDS, VARIANTS, Context
from polyengine.conformance.models import DEFAULT_MODEL, MODEL_NAMES, QUANTIZED_MODELS, build_model
from polyengine.conformance.oracle import ReferenceOracle, mirror_engine, reference_engine

__all__ = ["PROGRAMS", "EXAMPLES", "ARCHITECTURE_EXAMPLES", "EDGE_EXAMPLES", "SHAPE_MODELS", "STEPS", "run_programs", "edge_setup"]

# model, or model-variant: the engines the other layers build already
# The quantized models last: a configuration's seed is the base plus its index here, so
# the others keep the programs they drew before the quantized models came.
PROGRAMS = (*MODEL_NAMES, *(f"{DEFAULT_MODEL}-{v}" for v in VARIANTS if v != "standard"), *QUANTIZED_MODELS)
EXAMPLES = 10  # programs per configuration in a default run
ARCHITECTURE_EXAMPLES = 3  # ... per further architecture's model (scaled with --polyengine-differential-examples)
EDGE_EXAMPLES = 2  # ... per edge configuration of its own (layer_edges: the long-RoPE contexts)
SHAPE_MODELS = ("mha_tied", "gqa_llama3", "odd_qwen2")
STEPS = 25  # calls per program at most (a generate call runs up to 8 steps)
# Seconds Hypothesis may spend shrinking a failing program (its own default is 300;
# hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS). A safety net only, far
# above what SHRINK_STEPS takes: shrinking ends on its own (no shorter program fails, or
# SHRINK_STEPS successful shrinks), which makes the program shown depend on the seed
# alone. A time limit that shrinking reaches makes it depend on the host's speed (at
# 10 s, a busy CI host printed a 23-call program where an idle one printed 9; at 180 s,
# a 2-core host running six other jobs printed a 21-call program).
SHRINK_SECONDS = 600
# Successful shrinks at most (Hypothesis' own bound is 500,
# hypothesis.internal.conjecture.engine.MAX_SHRINKS): the bound that keeps a caught
# backend's report within the suite's time budget (docs/conformance.md, "Time budget")
# while the program shown still depends on the seed alone, never on the host's speed.
SHRINK_STEPS = 150
# ... under page pressure (test_programs_under_page_pressure): each of those programs
# starts with a full garbage collection of the process (the last program's prefixes give
# their pages back) and, after a failure, a new engine, so each attempt costs far more than
# an ordinary program's; 150 shrinks took a caught backend's report to 210 s on two cores
# (broken_page_refusal_advances), past the budget of 2 minutes; 25 took 12 s and showed a
# 14-call program. The program shown still depends on the seed alone.
PRESSURE_SHRINK_STEPS = 25


def _configuration(program: str) -> tuple[str, str]:
    model, _, variant = program.partition("-")
    return model, variant or "standard"


def _shared(conformance, model: str, variant: str):
    """The mirror and the oracle of a configuration, and another model's prefixes (for
    the refusals of foreign prefixes), built once per test class."""
    harness, dtype = conformance.harness, conformance.dtype
    key = ("differential", model, variant)
    if key not in harness.cache:
        engine = conformance.engine(model, dtype, variant)
        mirror = mirror_engine(build_model(model), harness.config(dtype, variant), engine.capabilities)
        harness.cache[key] = (mirror, mirror.load_params(), ReferenceOracle(build_model(model)))
    mirror, mirror_params, oracle = harness.cache[key]
    return mirror, mirror_params, oracle, lambda: _foreign(conformance, model)


def _foreign(conformance, model: str):
    """Another model's prefix on the backend and the reference, and its export (for the
    refusals of foreign prefixes), built once per test class."""
    harness, dtype = conformance.harness, conformance.dtype
    fkey = ("differential-foreign", model)
    if fkey not in harness.cache:
        other = next(m for m in MODEL_NAMES if m != model)
        other_engine = conformance.engine(other, dtype)
        prompt, sampling = conformance.prompt(5, 85, other), conformance.sampling(85)
        theirs, _ = other_engine.prefill(params=conformance.harness.params(other_engine), tokens=prompt, sampling=sampling)
        ref = reference_engine(build_model(other), harness.config("float64"))
        ref_prefix, _ = ref.prefill(params=ref.load_params(), tokens=prompt, sampling=sampling)
        harness.cache[fkey] = (theirs, ref_prefix, ref.export_prefix(ref_prefix))
    return harness.cache[fkey]


def edge_setup(conformance, model: str, engine, config):
    """What :func:`run_programs` runs an edge configuration's programs with (layer_edges):
    the backend's engine of that configuration, a mirror and an oracle of the same limits
    (long-RoPE picks its factors by the engine's context, so the oracle's must be the
    edge's), built once per test class."""
    harness = conformance.harness
    key = ("differential-edge", model, config.max_cache_length, config.max_prefill_length, config.prefill_buckets)
    if key not in harness.cache:
        mirror = mirror_engine(build_model(model), config, engine.capabilities)
        oracle = ReferenceOracle(build_model(model), context=config.max_cache_length)
        harness.cache[key] = (mirror, mirror.load_params(), oracle)
    mirror, mirror_params, oracle = harness.cache[key]
    describe = (f"model {model}, {conformance.dtype}, max_cache_length={config.max_cache_length}, "
                f"max_prefill_length={config.max_prefill_length}, prefill_buckets={config.prefill_buckets}")
    return engine, mirror, mirror_params, oracle, describe


@contextlib.contextmanager
def _draws_of_the_seed_alone():
    """Hypothesis mixes into its draws the literal constants of every "local" module
    (source outside site-packages) loaded so far in the process
    (``hypothesis.internal.conjecture.providers._get_local_constants``). The same seed
    therefore drew other programs in a long test session than in a fresh process, and a
    broken backend caught in one passed in the other. For the programs' run the pool of
    local constants is empty and its cache cleared, so a seed's programs depend on the
    seed and the Hypothesis version only. (A private function of Hypothesis: where it is
    missing the run goes on with Hypothesis' default.)"""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        original, cache = providers._get_local_constants, providers.CONSTANTS_CACHE.cache
    except (ImportError, AttributeError):
        yield
        return
    none = Constants()
    cache.clear()
    providers._get_local_constants = lambda: none
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.clear()


@contextlib.contextmanager
def _collections_of_the_programs_alone(on: bool):
    """Under page pressure each program starts with a full garbage collection
    (``ProgramRun._drained``). With ``on``, what the process held before the programs is
    frozen (``gc.freeze``) for their run, so those collections traverse what the programs
    made and no more: in a test process holding millions of objects (a pytest worker after
    other test files, 4 million objects) a caught backend's report took 79-148 s against
    12 s in a fresh process. Left alone where something froze the heap already."""
    if not on or gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_programs(conformance, program: str, *, examples: int, seed: int, rerun: str, setup=None,
                 pressure=None, shrinks: int = SHRINK_STEPS) -> None:
    """Run ``examples`` seeded random programs on one configuration; raise AssertionError
    with the shrunk failing program (``rerun``: the options that run it again). ``setup``:
    an edge configuration's engine, mirror, mirror params, oracle and description
    (:func:`edge_setup`); else the configuration ``program`` names. ``pressure``: the
    setup's engine's page pool is too small for the programs (ProgramRun.pressure), and
    this builds another like it (ProgramRun.rebuild). ``shrinks``: successful shrinks at
    most (SHRINK_STEPS)."""
    import importlib.util

    if importlib.util.find_spec("hypothesis") is None:
        raise AssertionError(
            "the differential layer draws its programs with Hypothesis, which is not installed: "
            "pip install 'polyengine[conformance]' (pytest and hypothesis)"
        )
    from hypothesis import HealthCheck, Phase, Verbosity, settings
    from hypothesis import seed as use_seed
    from hypothesis.errors import Flaky
    from hypothesis.internal.conjecture import engine as conjecture
    from hypothesis.stateful import run_state_machine_as_test

    from polyengine.conformance.program_checks import REQUIRED, declared_pairs
    from polyengine.conformance.programs import Program, ProgramFailure, ProgramRun

    model, variant = _configuration(program)
    dtype = conformance.dtype
    if setup is None:
        engine = conformance.engine(model, dtype, variant)
        mirror, mirror_params, oracle, foreign = _shared(conformance, model, variant)
        buckets = VARIANTS[variant].get("prefill_buckets")
        describe = f"model {model}, {dtype}, prefill_buckets={buckets}"
    else:
        engine, mirror, mirror_params, oracle, describe = setup
        foreign = lambda: _foreign(conformance, model)  # noqa: E731
        # judged as the differential layer's programs are (its tolerances and overrides), recorded in this test's report
        conformance = Context(conformance.harness, "test_differential", conformance.test_id, conformance.record)
    run = ProgramRun(conformance, engine, conformance.harness.params(engine), mirror, mirror_params, oracle, model, dtype,
                     describe, foreign, rebuild=pressure)
    config = settings(
        max_examples=examples, stateful_step_count=STEPS, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), report_multiple_bugs=False, phases=(Phase.generate, Phase.shrink),
        verbosity=Verbosity.quiet, print_blob=False,
    )

    def factory() -> Program:
        return Program(run)

    how = f"seed {seed}, {examples} programs: the run is deterministic, {rerun} runs it again"
    shrink_seconds, conjecture.MAX_SHRINKING_SECONDS = conjecture.MAX_SHRINKING_SECONDS, SHRINK_SECONDS
    shrink_steps, conjecture.MAX_SHRINKS = getattr(conjecture, "MAX_SHRINKS", None), shrinks
    started = time.perf_counter()
    try:
        with _draws_of_the_seed_alone(), _collections_of_the_programs_alone(pressure is not None):
            run_state_machine_as_test(use_seed(seed)(factory), settings=config)
        at = "" if setup is None else f" ({describe})"  # an edge's programs beside the edge test's own figures
        conformance.record.setdefault("statistics", {})["programs" + at] = {
            "seed": seed, "programs": examples, **run.counts}
        conformance.record["statistics"]["capability pairs" + at] = dict(sorted(run.pairs.items()))
        lossy = conformance.harness.option_set is not None and not conformance.harness.option_set.lossless
        # a lossy option set's streams leave the reference's at its wider near ties, so
        # fewer tokens are compared: there the pairs are reported, not required
        if model in SHAPE_MODELS and examples >= EXAMPLES and not lossy:
            missing = [p for p in declared_pairs(engine.capabilities, REQUIRED) if p not in run.pairs]
            if missing:
                raise AssertionError(
                    f"under-exercised ({describe}; {how}): no token was compared in a request that combined "
                    f"{', '.join(missing)}, though the backend declares each; pairs exercised: {run.pairs}. The "
                    f"programs' draws do not reach what the backend declares (a suite bug, or a backend whose "
                    f"streams leave the reference's at near ties so early that nothing is compared: see the notes)")
    except ProgramFailure as exc:
        # Hypothesis runs the shrunk program last: run.log is its log.
        cut = ""
        if time.perf_counter() - started >= SHRINK_SECONDS:
            cut = (f" (shrinking stopped at its time limit, SHRINK_SECONDS = {SHRINK_SECONDS} s: a shorter program "
                   f"may fail too, and another host may print another one)")
        raise AssertionError(
            f"{exc}\n\nthe program that fails, shrunk{cut} ({describe}; {how}); r is each call's ResultTokens, "
            f"P<i> its prefixes, X<i> its exports, [i] the call numbers the message names:\n{_listing(run.log)}"
        ) from None
    except Flaky as exc:
        message, log = run.first_failure or (str(exc), [])
        raise AssertionError(
            f"a program failed, and did not fail when run again ({describe}; {how}): the backend's outputs for a "
            f"seeded program are not deterministic ({type(exc).__name__}). The first failure:\n{message}\n\nits "
            f"program:\n{_listing(log)}"
        ) from None
    finally:
        conjecture.MAX_SHRINKING_SECONDS = shrink_seconds
        if shrink_steps is not None:
            conjecture.MAX_SHRINKS = shrink_steps


def _listing(log: list[str]) -> str:
    lines = "\n".join(f"  [{i}] {line}" for i, line in enumerate(log))
    if "token_mask" in lines:
        lines += ("\n(a token mask: mask(ids) is polyengine.sampling.masks.pack_mask of the vocabulary with those ids "
                  "allowed, mask(all_but=ids) with every other id allowed, words(w) the int32 words themselves)")
    return lines


def _rerun(conformance, examples: int, base: int | None) -> str:
    """The options that run a differential test's programs again (its -k, and the budget
    and seed where they are not the defaults)."""
    return f'-k "{conformance.test_id}"' + "".join(
        f" --polyengine-differential-{name} {value}" for name, value in (("examples", examples), ("seed", base))
        if value is not None and (name, value) != ("examples", EXAMPLES))


@layer("differential")
class DifferentialLayer:
    @pytest.mark.parametrize("program", PROGRAMS)
    def test_differential(self, conformance, program, request):
        """Random programs of protocol calls (prefill with and without existing_prefix,
        insert, bulk_insert, generate with and without overrides, free_resource,
        export_prefix/import_prefix, refusals mixed in; per-request sampling over every
        declared field; allowed-token masks where declared) give the reference's
        outputs: tokens (near ties reported), valid, lengths, log-probs, top log-probs,
        exported K/V, refusal types, and a refused call changes nothing; a masked-out
        token is never produced and a masked slot yields one token per step."""
        conformance.require_architecture(_configuration(program)[0])
        examples = request.config.getoption("polyengine_differential_examples", None) or EXAMPLES
        if _configuration(program)[0] not in SHAPE_MODELS:
            examples = max(1, examples * ARCHITECTURE_EXAMPLES // EXAMPLES)
        base = request.config.getoption("polyengine_differential_seed", None)
        seed = (SEEDS["differential"] if base is None else base) + PROGRAMS.index(program)
        run_programs(conformance, program, examples=examples, seed=seed, rerun=_rerun(conformance, examples, base))

    def test_programs_under_page_pressure(self, conformance, request):
        """On an engine that declares page_size and takes the option kv_pages (a bounded
        pool): the programs on the default model with a pool of two contexts' pages and
        one more, which prefills, imports and steps run out of. A call the pool refuses
        must raise InsufficientMemory and change nothing: the programs go on against a
        reference that never made it, and everything else gives the reference's outputs.
        At least one call must have been refused (else the pool was not under pressure)."""
        from polyengine.pages import pages_for

        engine = conformance.engine()
        ps = engine.capabilities.page_size
        if not ps:
            pytest.skip("page_size is not declared: a contiguous cache has no page pool to run out of")
        if "kv_pages" not in (getattr(engine, "OPTIONS", None) or {}):
            pytest.skip("the backend has no option kv_pages (a bounded page pool) to put the programs under pressure")
        harness = conformance.harness
        pages = 2 * pages_for(LIMITS["max_cache_length"], ps) + 1
        config = harness.config(conformance.dtype, options={**harness.options, "kv_pages": pages})
        pressured = harness.build_for(DEFAULT_MODEL, config)
        examples = request.config.getoption("polyengine_differential_examples", None) or EXAMPLES
        base = request.config.getoption("polyengine_differential_seed", None)
        seed = (SEEDS["differential"] if base is None else base) + 500
        rerun = _rerun(conformance, examples, base)
        setup = edge_setup(conformance, DEFAULT_MODEL, pressured, config)
        describe = f"{setup[-1]}, kv_pages={pages} of {ps} positions"
        run_programs(conformance, DEFAULT_MODEL, examples=examples, seed=seed, rerun=rerun,
                     setup=(*setup[:-1], describe), pressure=lambda: harness.build_for(DEFAULT_MODEL, config),
                     shrinks=PRESSURE_SHRINK_STEPS)
        counts = conformance.record["statistics"][f"programs ({describe})"]
        assert counts.get("page refusals", 0) > 0, (
            f"no call ran out of pages in {examples} programs with kv_pages={pages}: the pool was not under "
            f"pressure ({counts})")
