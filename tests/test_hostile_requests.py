"""Hostile inputs, class "requests that leak or spin": a stream that is never started
and then closed or dropped, a queue of size zero, prompts and messages that are not
valid Unicode (lone surrogates, as a shell passes undecodable bytes). Each ends in a
typed error or a clean cancellation, and requests submitted around it still finish.
"""

from __future__ import annotations

import gc
import json
import threading

from hostile_plugins import polyengine
from hostile_runner import case, check, run_cases
from polyengine.errors import InvalidRequest


def _llm(**kw):
    import polyengine as pe

    return pe.LLM("random:tiny", "reference", max_cache_length=64, max_slots=2, **kw)


def _still_serves(llm) -> None:
    out = llm.generate(["after"], {"max_tokens": 3, "seed": 2})[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@case(None)
def an_unstarted_stream_closed_is_cancelled(tmp):
    llm = _llm()
    stream = llm.stream("never read", {"max_tokens": 5})
    stream.close()
    assert not llm.scheduler.busy, "the closed stream's request is still queued"
    _still_serves(llm)


@case(None)
def an_unstarted_stream_dropped_is_cancelled(tmp):
    llm = _llm()
    llm.stream("never read", {"max_tokens": 5})
    gc.collect()
    assert not llm.scheduler.busy, "the dropped stream's request is still queued"
    _still_serves(llm)


@case(None)
def many_unstarted_streams_do_not_block_later_requests(tmp):
    llm = _llm(max_queue=4)
    for _ in range(10):
        llm.stream("never read", {"max_tokens": 50}).close()
    _still_serves(llm)


@case(None)
def a_half_read_stream_closed_frees_its_slot(tmp):
    llm = _llm()
    stream = llm.stream("read a bit", {"max_tokens": 50})
    next(iter(stream))
    stream.close()
    assert not llm.scheduler.busy
    _still_serves(llm)


@case(InvalidRequest, "max_queue", "at least 1", seconds=5)
def a_queue_of_size_zero(tmp):
    _llm(max_queue=0)


@case(InvalidRequest, "max_queue", "integer", seconds=5)
def a_queue_size_that_is_not_an_integer(tmp):
    _llm(max_queue=2.5)


@case(InvalidRequest, "prompt", "surrogate", seconds=5)
def a_prompt_with_a_lone_surrogate(tmp):
    llm = _llm()
    try:
        llm.generate(["bad \udcff bytes"], {"max_tokens": 2})
    finally:
        _still_serves(llm)


@case(InvalidRequest, "surrogate", seconds=5)
def a_chat_message_with_a_lone_surrogate(tmp):
    llm = _llm()
    try:
        llm.chat([{"role": "user", "content": "bad \ud800 bytes"}], {"max_tokens": 2})
    finally:
        _still_serves(llm)


@case(InvalidRequest, "stop", "surrogate", seconds=5)
def a_stop_string_with_a_lone_surrogate(tmp):
    llm = _llm()
    try:
        llm.generate(["fine"], {"max_tokens": 2, "stop": ["\udcff"]})
    finally:
        _still_serves(llm)


@case(None)
def streams_from_several_threads_with_one_abandoned(tmp):
    llm = _llm()
    llm.stream("abandoned", {"max_tokens": 40})
    results, errors = [], []

    def worker(i):
        try:
            results.append("".join(d.text for d in llm.stream(f"thread {i}", {"max_tokens": 4, "seed": i})))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 3


def test_requests_never_leak_or_spin(tmp_path):
    results = run_cases(__name__.rpartition(".")[2], tmp_path)
    problems = check(__name__.rpartition(".")[2], results)
    assert not problems, "\n".join(problems)


def test_invalid_utf8_on_the_command_line_is_a_typed_error(tmp_path):
    proc = polyengine(tmp_path, "generate", "--model", "random:tiny", "--backend", "reference",
                      "--max-tokens", "2", "bad \udcff bytes")
    assert proc.returncode == 1, proc.stderr
    assert "surrogate" in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_utf8_in_a_chat_session_does_not_end_it(tmp_path):
    # The child decodes stdin with surrogateescape, as Python does for undecodable bytes.
    proc = polyengine(tmp_path, "chat", "--model", "random:tiny", "--backend", "reference", "--max-tokens", "2",
                      "--seed", "1", stdin="bad \udcff bytes\nhello\n",
                      env={"PYTHONIOENCODING": "utf-8:surrogateescape"})
    assert proc.returncode == 0, proc.stderr
    assert "surrogate" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout.count("assistant>") == 1  # the second line was answered


def test_json_output_of_a_hostile_prompt_is_valid_json(tmp_path):
    proc = polyengine(tmp_path, "generate", "--model", "random:tiny", "--backend", "reference", "--raw",
                      "--max-tokens", "4", "--seed", "3", "--json", "\x1b[31m\u202e\ufeff\x07")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 4
