"""Traces without sockets: the format, its errors, the recorder fed by a real
BrokerCore, the generators, the outcome comparison and the replay checker."""

from __future__ import annotations

import collections
import json
import os
import random
import signal

import pytest

from zkv.broker.core import BrokerConfig, BrokerCore, Record, ToRank
from zkv.replay import (
    ControlResult,
    Observation,
    Observed,
    ObservingBook,
    check,
    format_report,
    parse_speed,
    rank_stats_fresh,
)
from zkv.trace import (
    TraceError,
    TraceRecorder,
    check_recording,
    compare_outcomes,
    decode_ids,
    encode_ids,
    generate,
    parse_trace,
)
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout
from zkv.wire.messages import Result

LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=128, block_size=16, kv_heads=2, head_dim=64)
HEADER = json.dumps({"zkv_trace": 1, "world": 2, "layout": LAYOUT.to_wire()})


def parse(*lines: str, header: str = HEADER):
    return parse_trace([header, *lines], "t.jsonl")


# --- format ----------------------------------------------------------------------------------


def test_ids_encode_compactly_and_round_trip():
    assert encode_ids([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10,11"
    assert encode_ids([5, 9]) == [5, 9]  # nothing to gain
    assert encode_ids([3, 1, 2]) == [3, 1, 2]  # order is kept
    assert decode_ids("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(40) for _ in range(rng.randrange(0, 12))]
        if rng.random() < 0.5:
            ids.sort()
        assert decode_ids(encode_ids(ids)) == ids


def test_hand_written_trace_defaults_and_expectations():
    t = parse(
        "# a comment, and a blank line next",
        "",
        '{"t": 0, "ev": "submit", "op": "swap_out", "src": "0-3", "dst": [4, 5, 6, 7], "expect": "ok"}',
        '{"t": 0.5, "ev": "pause"}',
        '{"ev": "submit", "op": "fill", "dst": [1], "tier": "cpu", "seed": 2, "expect": ["cancelled", "ok"]}',
        '{"t": 0.7, "ev": "clear", "keep_cpu": true, "expect": "ok"}',
        '{"t": 0.8, "ev": "resume", "layout": {"gpu_blocks": 32}, "expect": ["ok", "noop"]}',
    )
    assert [(op.ev, op.line, op.client, op.t) for op in t.ops] == [
        ("submit", 4, "c0", 0.0),
        ("pause", 5, "ctl", 0.5),
        ("submit", 6, "c0", 0.5),
        ("clear", 7, "ctl", 0.7),
        ("resume", 8, "ctl", 0.8),
    ]
    first, second = t.tasks[("c0", 1)], t.tasks[("c0", 2)]
    assert P.decode_body(t.ops[0].body) == P.TaskBody("swap_out", [0, 1, 2, 3], [4, 5, 6, 7])
    assert P.decode_body(t.ops[2].body) == P.TaskBody("fill", [], [1], "cpu", 2)
    assert first.expects == [(4, ("ok",))] and second.expects == [(6, ("cancelled", "ok"))]
    assert t.ops[3].params == {"keep_cpu": True} and t.ops[4].params == {"layout": {"gpu_blocks": 32}}
    assert t.ops[1].expect is None and t.ops[4].expect == ("ok", "noop")


BAD = [
    ('{"zkv_trace": 2, "world": 2}', [], 1, "version 2"),
    ("{not json", [], 1, "not valid JSON"),
    (HEADER, ['{"ev": "pause"}', '{"ev": "sumbit", "op": "swap_out"}'], 3, "unknown record type ev='sumbit'"),
    (HEADER, ['{"ev": "submit", "op": "swap_sideways", "src": [1], "dst": [1]}'], 2, "unknown op 'swap_sideways'"),
    (HEADER, ['{"ev": "pause"}', "", '{"ev": "pause", "t": 1', '{"ev": "resume"}'], 4, "not valid JSON"),
    (HEADER, ["[1, 2]"], 2, "must be a JSON object"),
    ('{"ev": "pause"}', [], 1, "first record must be the header"),
    (HEADER, ['{"t": 1, "ev": "pause"}', '{"t": 0.5, "ev": "resume"}'], 3, "time goes backwards"),
    (HEADER, ['{"ev": "submit", "op": "swap_out", "src": "0-x", "dst": [1]}'], 2, "'0-x' is not an id"),
    (
        HEADER,
        ['{"ev": "submit", "op": "swap_out", "src": [1], "dst": [1], "expect": "fine"}'],
        2,
        "unknown outcome 'fine'",
    ),
    (
        HEADER,
        ['{"ev": "submit", "op": "swap_out", "src": [1], "dst": [1], "expcet": "ok"}'],
        2,
        "unknown field 'expcet'",
    ),
    (
        HEADER,
        [
            '{"ev": "submit", "task": 1, "op": "checksum", "src": [1]}',
            '{"ev": "submit", "task": 1, "op": "checksum", "src": [2]}',
        ],
        3,
        "already submitted at line 2",
    ),
    (HEADER, ['{"ev": "outcome", "client": "c0", "task": 4, "outcome": "ok"}'], 2, "no earlier submit record names"),
    (HEADER, ['{"ev": "pause", "keep_cpu": true}'], 2, "keep_cpu belongs to clear"),
    ('{"zkv_trace": 1, "world": 0}', [], 1, "world must be a positive integer"),
    ('{"zkv_trace": 1, "world": 2, "layout": {"gpu_blocks": -1}}', [], 1, "bad layout"),
    (HEADER, [HEADER.replace('"world": 2', '"world": 4')], 2, "world 4"),
]


@pytest.mark.parametrize("header,lines,line,fragment", BAD, ids=[b[3] for b in BAD])
def test_bad_traces_name_the_line(header, lines, line, fragment):
    with pytest.raises(TraceError) as err:
        parse(*lines, header=header)
    assert err.value.line == line
    assert fragment in str(err.value) and f"t.jsonl, line {line}:" in str(err.value)


def test_empty_trace_is_an_error():
    with pytest.raises(TraceError, match="no header"):
        parse_trace(["", "# nothing"], "e.jsonl")


def test_appended_sessions_scope_clients_and_continue_time():
    t = parse(
        '{"t": 1, "ev": "submit", "client": "aa", "task": 1, "op": "checksum", "src": [0]}',
        '{"t": 2, "ev": "outcome", "client": "aa", "task": 1, "outcome": "ok"}',
        HEADER,
        '{"t": 0.5, "ev": "submit", "client": "aa", "task": 1, "op": "checksum", "src": [0]}',
        '{"t": 0.6, "ev": "outcome", "client": "aa", "task": 1, "outcome": "failed"}',
    )
    assert t.segments == 2
    assert [(op.client, op.t) for op in t.ops] == [("aa", 1.0), ("s1/aa", 2.5)]
    assert [s.recorded for s in t.tasks.values()] == [[(3, "ok")], [(6, "failed")]]
    assert check_recording(t) == []


# --- the recorder, fed by the real broker core -------------------------------------------------------


class CoreHarness:
    """BrokerCore with two ranks that answer at once; Records go to the recorder."""

    def __init__(self, recorder):
        self.core = BrokerCore(BrokerConfig(world=2), recording=True)
        self.recorder = recorder
        self.now = 100.0
        self.req = 0
        for r in range(2):
            self.rank(r, P.encode("ready", rank=r, world=2, session=1, layout=LAYOUT.to_wire(), gen=0))

    def feed(self, actions):
        for a in actions:
            if isinstance(a, Record):
                self.recorder(a.event)
        return actions

    def rank(self, r, frame):
        self.now += 0.001
        return self.feed(self.core.on_rank(f"rank-{r}".encode(), [frame], self.now))

    def client(self, client, frames):
        self.now += 0.001
        actions = self.feed(self.core.on_client(client, frames, self.now))
        for a in actions:  # ranks finish every dispatched task at once
            if isinstance(a, ToRank) and len(a.frames) == 2:
                head = P.decode(a.frames[0])
                self.rank(int(a.identity[5:]), P.encode("done", seq=head.seq, n=head.n, outcome="ok", gen=head.gen))
        return actions

    def submit(self, client, task, body):
        return self.client(client, [P.encode("submit", task=task, reply_to="ipc:///tmp/nowhere"), body])

    def control(self, client, op, **fields):
        self.req += 1
        self.client(client, [P.encode(op, req=self.req, **fields)])
        epoch = self.core.epoch
        for r in range(2):
            extra = {"upto": self.core.ranks[r].dispatched} if op == "pause" else {}
            self.rank(r, P.encode("ack", epoch=epoch, op=op, gen=self.core.gen, **extra))
        assert self.core.pending is None


def test_recorder_writes_a_replayable_trace_from_broker_records(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = TraceRecorder(str(path), world=2, layout=LAYOUT, clock=lambda: 100.0, flush_interval=60)
    h = CoreHarness(rec)
    a, b = b"\x00\x01\x02\x03\x04", b"\x00\x09\x09\x09\x09"
    h.submit(a, 1, P.encode_body("swap_out", [0, 1, 2, 3, 9], [4, 5, 6, 7, 8]))
    h.submit(b, 1, P.encode_body("fill", None, [3], tier="cpu", seed=7))
    h.control(b, "pause")
    h.submit(a, 2, P.encode_body("swap_in", [1], [2]))  # held, then cancelled by the clear
    h.control(b, "clear", keep_cpu=False)
    h.control(b, "resume")
    h.submit(a, 3, b"\x92\x01")  # not a body: forwarded as is, recorded as raw bytes
    rec.close()
    rec.close()  # idempotent
    lines = path.read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert records[0]["zkv_trace"] == 1 and records[0]["world"] == 2 and records[0]["layout"] == LAYOUT.to_wire()
    assert [r["ev"] for r in records[1:]] == [
        "rank",
        "rank",
        "submit",
        "outcome",
        "submit",
        "outcome",
        "pause",
        "control",
        "submit",
        "clear",
        "outcome",
        "control",
        "resume",
        "control",
        "submit",
        "outcome",
    ]
    first = records[3]
    assert first == {
        "t": first["t"],
        "ev": "submit",
        "client": a.hex(),
        "task": 1,
        "op": "swap_out",
        "src": "0-3,9",
        "dst": "4-8",
    }
    assert 0 < first["t"] < 1  # seconds since the recorder started, not the broker's clock
    assert records[5]["tier"] == "cpu" and records[5]["seed"] == 7 and records[5]["dst"] == [3]
    assert records[11]["outcome"] == "cancelled" and records[11]["task"] == 2
    assert "body_b64" in records[15] and "undecodable" in records[15]["note"]
    t = parse_trace(lines, str(path))
    assert check_recording(t) == []
    assert [op.ev for op in t.ops] == ["submit", "submit", "pause", "submit", "clear", "resume", "submit"]
    assert t.ops[-1].body == b"\x92\x01"
    assert [s.recorded[0][1] for s in t.tasks.values()] == ["ok", "ok", "cancelled", "ok"]


@pytest.mark.parametrize("helper", [True, False], ids=["helper-process", "in-process"])
def test_recorder_flushes_and_appends(tmp_path, helper):
    path = tmp_path / "rec.jsonl"
    rec = TraceRecorder(str(path), world=1, helper=helper)
    assert (rec.helper_pid is not None) == helper
    rec({"ev": "rank", "t": rec.t0, "rank": 0, "up": True})
    rec.flush()
    assert path.read_text().count("\n") == 2
    rec.close()
    rec2 = TraceRecorder(str(path), world=1, helper=helper)
    rec2({"ev": "mystery", "t": rec2.t0 + 1, "x": 1})
    rec2.close()
    t = parse_trace(path.read_text().splitlines())
    assert t.segments == 2
    assert json.loads(path.read_text().splitlines()[-1]) == {"t": 1.0, "ev": "note", "event": "mystery", "x": 1}


def test_recorder_survives_its_helper_dying(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = TraceRecorder(str(path), world=1)
    rec({"ev": "rank", "t": rec.t0, "rank": 0, "up": True})
    rec.flush()
    os.kill(rec.helper_pid, signal.SIGKILL)
    rec({"ev": "rank", "t": rec.t0 + 1, "rank": 0, "up": False})
    rec.close()
    assert rec.errors == 1 and rec.helper_pid is None
    assert [json.loads(x).get("up") for x in path.read_text().splitlines()] == [None, True, False]


def test_a_layout_in_a_rank_record_fills_a_null_header():
    t = parse(
        '{"ev": "rank", "rank": 0, "up": true, "layout": %s}' % json.dumps(LAYOUT.to_wire()),
        header='{"zkv_trace": 1, "world": 2, "layout": null}',
    )
    assert t.layout == LAYOUT


def test_recording_with_a_missing_or_double_outcome_is_flagged():
    t = parse(
        '{"ev": "submit", "client": "x", "task": 1, "op": "checksum", "src": [0]}',
        '{"ev": "submit", "client": "x", "task": 2, "op": "checksum", "src": [0]}',
        '{"ev": "outcome", "client": "x", "task": 2, "outcome": "ok"}',
        '{"ev": "outcome", "client": "x", "task": 2, "outcome": "ok"}',
    )
    problems = check_recording(t)
    assert [p["lines"] for p in problems] == [[2], [3, 4, 5]]


# --- generators ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["steady", "bursty", "rl-cycle"])
def test_generated_traces_parse_and_are_reproducible(shape):
    recs = list(generate(shape, 50, seed=4, layout=LAYOUT, every=10))
    assert recs == list(generate(shape, 50, seed=4, layout=LAYOUT, every=10))
    t = parse_trace([json.dumps(r) for r in recs])
    assert len(t.tasks) == 50 and t.layout == LAYOUT
    for op in t.submits():
        body = P.decode_body(op.body)
        gpu, cpu = (body.src, body.dst) if body.op == "swap_out" else (body.dst, body.src)
        assert all(0 <= i < LAYOUT.gpu_blocks for i in gpu) and all(0 <= i < LAYOUT.cpu_blocks for i in cpu)
        assert len(set(body.dst)) == len(body.dst)
    times = [op.t for op in t.ops]
    assert times == sorted(times)
    if shape == "bursty":
        assert len({op.client for op in t.ops}) == 2 and len(set(times)) == 4


def test_rl_cycle_expects_ok_cancelled_rejected_by_phase():
    t = parse_trace([json.dumps(r) for r in generate("rl-cycle", 13, seed=1, layout=LAYOUT, every=4, held=1)])
    seq = [op.ev if op.ev != "submit" else "|".join(t.tasks[op.key].expects[0][1]) for op in t.ops]
    cycle = ["pause", "cancelled", "clear", "rejected", "resume"]
    # before a pause a task may still be queued behind the credits: held, then cancelled
    assert seq == ["ok|cancelled"] * 4 + cycle + ["ok|cancelled"] * 4 + cycle + ["ok"]
    assert {op.client for op in t.controls()} == {"ctl"} and all(op.expect == ("ok",) for op in t.controls())


def test_generator_rejects_unknown_shapes():
    with pytest.raises(ValueError, match="unknown shape"):
        list(generate("spiky"))


# --- comparing recordings ------------------------------------------------------------------------


def _recording(clients, outcomes):
    lines = [HEADER]
    for i, (client, outcome) in enumerate(zip(clients, outcomes)):
        lines.append(
            json.dumps({"t": i, "ev": "submit", "client": client, "task": i, "op": "checksum", "src": [i % 2]})
        )
        lines.append(json.dumps({"t": i, "ev": "outcome", "client": client, "task": i, "outcome": outcome}))
    return parse_trace(lines, f"rec-{clients[0]}")


def test_compare_matches_clients_by_what_they_submit():
    a = _recording(["aa", "bb", "aa"], ["ok", "ok", "cancelled"])
    b = _recording(["zz", "yy", "zz"], ["ok", "ok", "cancelled"])
    assert compare_outcomes(a, b) == []
    c = _recording(["zz", "yy", "zz"], ["ok", "ok", "ok"])
    diffs = compare_outcomes(a, c)
    assert len(diffs) == 1 and diffs[0]["lines_a"] == [6] and "['cancelled']" in diffs[0]["message"]
    d = _recording(["zz", "yy"], ["ok", "ok"])
    assert compare_outcomes(a, d)[0]["kind"] == "different_tasks"


# --- the checker ---------------------------------------------------------------------------------


SMALL = [
    '{"ev": "submit", "task": 1, "op": "swap_out", "src": [0], "dst": [0], "expect": "ok"}',  # line 2
    '{"ev": "pause", "expect": "ok"}',  # 3
    '{"ev": "submit", "task": 2, "op": "swap_out", "src": [1], "dst": [1]}',  # 4
    '{"ev": "outcome", "task": 2, "outcome": "cancelled"}',  # 5
    '{"ev": "clear", "expect": "ok"}',  # 6
    '{"ev": "resume", "expect": ["ok"]}',  # 7
]


def good_observation(trace):
    obs = Observation(outcomes=collections.defaultdict(list), duration_s=0.5, target="test")
    obs.submitted = set(trace.tasks)
    obs.outcomes[("c0", 1)].append(Observed("ok", "", 1.0))
    obs.outcomes[("c0", 2)].append(Observed("cancelled", "cleared", 5.0))
    for op in trace.controls():
        obs.controls.append(
            ControlResult(
                op.line, op.ev, op.client, "ok", "", 2.0, {"drain_ms": 1.5} if op.ev == "pause" else {}, op.expect
            )
        )
    ranks = [
        {"rank": r, "alive": True, "pid": 10 + r, "dispatched": 1, "stats": {"copies_after_ack": 3, "tasks_ok": 1}}
        for r in range(2)
    ]
    obs.ranks_before, obs.ranks_after = ranks, json.loads(json.dumps(ranks))
    return obs


def test_checker_passes_a_good_run_and_reports_figures():
    t = parse(*SMALL)
    rep = check(t, good_observation(t))
    assert rep.ok, rep.violations
    assert rep.outcomes == {"cancelled": 1, "ok": 1} and rep.tasks == 2
    assert rep.latency_ms == {"n": 1, "p50": 1.0, "p99": 1.0, "max": 1.0}
    assert rep.throughput_tasks_per_s == 4.0
    assert rep.controls["pause"]["drain_ms"]["p50"] == 1.5 and rep.controls["clear"]["results"] == {"ok": 1}
    assert [r["copies_after_ack"] for r in rep.ranks] == [0, 0]  # a delta: 3 before, 3 after
    assert "OK:" in format_report(rep)


def test_checker_names_the_violating_lines():
    t = parse(*SMALL)
    obs = good_observation(t)
    obs.outcomes[("c0", 1)] = [Observed("rejected", "cleared", 1.0)]
    obs.outcomes[("c0", 2)].append(Observed("ok", "", 1.0))
    obs.controls[2].result, obs.controls[2].reason = "resume_timeout", "rank 1 did not acknowledge"
    obs.ranks_after[1]["stats"]["copies_after_ack"] = 4
    obs.ranks_after[0]["stats"]["copies_after_ack"] = 5
    obs.anomalies.append((("c0", 1), "rank 0 reported it twice"))
    rep = check(t, obs)
    got = [(v["kind"], v["lines"]) for v in rep.violations]
    assert got == [
        ("unexpected_outcome", [2]),
        ("duplicate_outcome", [4]),
        ("reported_twice", [2]),
        ("unexpected_control", [7]),
        ("copy_while_paused", [3, 6]),
        ("copy_while_paused", [3, 6]),
    ]
    assert not rep.ok and "line 7: [unexpected_control]" in format_report(rep)
    assert "rank 1 ran work while paused: copies_after_ack +1" in rep.violations[-1]["message"]


def test_checker_flags_missing_outcomes_expectations_from_outcome_records_and_stale_stats():
    t = parse(*SMALL)
    obs = good_observation(t)
    obs.outcomes[("c0", 2)] = [Observed("ok", "", 1.0)]  # the outcome record (line 5) said cancelled
    del obs.outcomes[("c0", 1)]
    obs.stats_fresh = False
    kinds = [(v["kind"], v["lines"]) for v in check(t, obs).violations]
    assert kinds == [("no_outcome", [2]), ("unexpected_outcome", [4, 5]), ("unverified", [])]
    obs.submitted.discard(("c0", 1))
    assert check(t, obs).violations[0]["kind"] == "not_replayed"


def test_checker_holds_cancellations_to_fifo_order():
    t = parse(
        '{"ev": "submit", "task": 1, "op": "checksum", "src": [0], "expect": ["ok", "cancelled"]}',  # line 2
        '{"ev": "submit", "task": 2, "op": "checksum", "src": [0], "expect": ["ok", "cancelled"]}',  # 3
        '{"ev": "submit", "client": "c1", "task": 1, "op": "checksum", "src": [0]}',  # 4
        '{"ev": "pause"}',
        '{"ev": "clear"}',  # 5, 6
        '{"ev": "submit", "task": 3, "op": "checksum", "src": [0]}',
    )  # 7
    obs = Observation(duration_s=1.0, stats_fresh=True, ranks_after=[])
    obs.submitted = set(t.tasks)
    for key, outcome in [(("c0", 1), "cancelled"), (("c0", 2), "ok"), (("c1", 1), "ok"), (("c0", 3), "ok")]:
        obs.outcomes[key].append(Observed(outcome, "", 1.0))
    got = [(v["kind"], v["lines"]) for v in check(t, obs).violations]
    assert got == [("fifo", [2, 3])]  # another client, or a task after the clear, may run


def test_a_restarted_rank_starts_its_counters_from_zero():
    t = parse(*SMALL)
    obs = good_observation(t)
    obs.ranks_after[0]["pid"] = 99  # a new process: its counters are all new
    rep = check(t, obs)
    assert rep.violations[0]["kind"] == "copy_while_paused" and rep.ranks[0]["copies_after_ack"] == 3


def test_stats_are_fresh_only_when_they_cover_every_dispatched_task():
    st = {
        "inflight": 0,
        "ranks": [
            {"alive": True, "dispatched": 5, "stats": {"tasks_ok": 4, "tasks_failed": 1}},
            {"alive": False, "dispatched": 9, "stats": {}},
        ],
    }
    assert rank_stats_fresh(st)
    st["ranks"][0]["dispatched"] = 6
    assert not rank_stats_fresh(st)
    assert not rank_stats_fresh({"inflight": 1, "ranks": []})
    assert not rank_stats_fresh({"inflight": 0, "ranks": [{"alive": True, "dispatched": 0, "stats": {}}]})


def test_observing_book_tells_double_reports_from_late_ones():
    book = ObservingBook()
    res = {"world": 2, "outcome": "ok", "reason": "", "gen": 0}

    def result(**fields):
        return Result(**res, **fields)

    for task in (1, 2, 3, 4):
        book.add(task, 0.0, 10.0)
    book.on_result(result(task=1, rank=0), 1.0)
    book.on_result(result(task=1, rank=0), 1.0)  # rank 0 again
    assert book.on_result(result(task=1, rank=1), 1.0).outcome == "ok"
    book.on_result(result(task=1, rank=1), 1.0)  # after the task ended
    book.on_outcome(2, "cancelled", "cleared", 1.0)
    book.on_result(result(task=2, rank=0), 1.0)  # ran although cancelled
    book.on_outcome(2, "cancelled", "cleared", 1.0)  # reported twice
    assert [o.task for o in book.expire(20.0)] == [3, 4]
    book.on_result(result(task=3, rank=0), 21.0)  # late after a client timeout: allowed
    book.on_outcome(4, "rejected", "", 21.0)
    assert [t for t, _ in book.anomalies] == [1, 1, 2, 2]


@pytest.mark.parametrize("text,value", [("1", 1.0), ("2.5", 2.5), ("10x", 10.0), ("max", None), (None, 1.0)])
def test_speed_parses(text, value):
    assert parse_speed(text) == value


@pytest.mark.parametrize("text", ["-1", "fast", "nan"])
def test_bad_speed_is_refused(text):
    with pytest.raises(ValueError):
        parse_speed(text)
