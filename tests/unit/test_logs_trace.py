"""Structured log records and the Chrome trace format."""

import asyncio
import gc
import json
import logging

from controller.logs import (
    JsonFormatter,
    TextFormatter,
    _ContextFilter,
    log_context,
    set_log_context,
)
from slicewise.common.trace import SpanRecorder, chrome_trace


def _record(msg="hello"):
    record = logging.LogRecord("controller.core", logging.INFO, __file__, 1, msg, None, None)
    _ContextFilter().filter(record)
    return record


def test_json_log_lines_carry_gang_and_job_from_the_context():
    with log_context(gang="g7", job="j2"):
        line = JsonFormatter().format(_record("gang admitted"))
    out = json.loads(line)
    assert out["gang"] == "g7" and out["job"] == "j2"
    assert out["msg"] == "gang admitted" and out["level"] == "INFO"
    assert out["ts"].endswith("Z")
    assert "gang" not in json.loads(JsonFormatter().format(_record()))


def test_text_log_lines_tag_the_gang():
    with log_context(gang="g3"):
        assert TextFormatter().format(_record("x")).endswith("[gang=g3]")
    assert "[" not in TextFormatter().format(_record("x"))


def test_task_context_does_not_leak_between_tasks():
    seen = {}

    async def handler(name, gang):
        set_log_context(gang=gang)
        await asyncio.sleep(0)
        seen[name] = getattr(_record(), "gang", None)

    async def main():
        await asyncio.gather(handler("a", "g1"), handler("b", "g2"))
        seen["outside"] = getattr(_record(), "gang", None)

    asyncio.run(main())
    assert seen == {"a": "g1", "b": "g2", "outside": None}


def test_span_recorder_filters_and_is_bounded():
    rec = SpanRecorder(capacity=3)
    for i in range(5):
        rec.record(f"s{i}", "execute", 100 + i, 110 + i, gang="g1" if i % 2 else "g2")
    spans = rec.spans()
    assert [s.name for s in spans] == ["s2", "s3", "s4"]
    assert [s.name for s in rec.spans(where={"gang": "g1"})] == ["s3"]
    assert [s.name for s in rec.spans(since_us=104)] == ["s4"]
    assert spans[0].duration_us == 10


def test_chrome_trace_names_processes_and_threads():
    a, b = SpanRecorder(), SpanRecorder()
    a.record("dispatch exec", "dispatch", 10, 20, thread="gang g1", seq=1)
    b.record("execute f", "execute", 12, 19, thread="executor")
    b.record("receive pieces", "transfer", 5, 9, thread="data", bytes=64)
    trace = chrome_trace([("controller", a.spans()), ("host 0 of slice s", b.spans())])
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "controller", 1: "host 0 of slice s"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["name"], e["dur"]) for e in spans} == {
        (0, "dispatch exec", 10),
        (1, "execute f", 7),
        (1, "receive pieces", 4),
    }
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(0, "gang g1"), (1, "executor"), (1, "data")}
    json.dumps(trace)  # serializable as is


def test_span_recorder_gives_the_last_spans_and_removes_a_gangs():
    rec = SpanRecorder()
    for i in range(6):
        rec.record(f"s{i}", "dispatch", 100 + i, 110 + i, gang="g1" if i % 2 else "g2")
    assert [s.name for s in rec.spans(last=2)] == ["s4", "s5"]
    assert [s.name for s in rec.spans(where={"gang": "g1"}, last=2)] == ["s3", "s5"]
    assert [s.name for s in rec.remove(where={"gang": "g1"})] == ["s1", "s3", "s5"]
    assert [s.name for s in rec.spans()] == ["s0", "s2", "s4"]
    assert rec.remove(where={"gang": "g1"}) == [] and len(rec.spans()) == 3


def test_a_span_recorded_for_later_is_described_only_when_read():
    described = []

    def describe(seq):
        described.append(seq)
        return f"execute {seq}", "execute", "programs", {"gang": "g1", "seq": seq}

    recorder = SpanRecorder(capacity=10)
    recorder.record("put", "execute", 5, 7, thread="executor", gang="g1")
    code = recorder.describer(describe)
    assert recorder.describer(describe) == code  # one code per function
    for seq in range(3):
        recorder.record_later(10 + seq, 12 + seq, code, seq)
    assert described == []  # nothing formatted while nobody reads
    spans = recorder.spans(since_us=11)
    assert [(s.name, s.start_us, s.duration_us, s.thread) for s in spans] == [
        ("execute 1", 11, 2, "programs"),
        ("execute 2", 12, 2, "programs"),
    ]
    assert [s.name for s in recorder.remove(where={"gang": "g1", "seq": 0})] == ["execute 0"]
    assert [s.name for s in recorder.spans()] == ["put", "execute 1", "execute 2"]


def test_spans_recorded_for_later_leave_the_collector_nothing_to_walk():
    # A ring of spans of operations, one per operation, would otherwise be hundreds of
    # thousands of objects that every full collection walks (see SpanRecorder).
    def describe(gang, seq, outputs, error):
        return "execute", "execute", "programs", {"gang": gang, "seq": seq}

    recorder = SpanRecorder(capacity=10_000)
    code = recorder.describer(describe)
    gc.collect()
    before = len(gc.get_objects())
    for seq in range(5_000):
        recorder.record_later(seq, seq + 1, code, "g1", seq, (f"g1/c.{seq}",), None)
    gc.collect()
    assert len(gc.get_objects()) - before < 1_000
    assert recorder.spans(last=1)[0].args == {"gang": "g1", "seq": 4_999}
