"""Messages of one wakeup travel together (docs/protocol.md §3,
§10.3): the broker sends a rank the tasks it dispatched in one wakeup as one
message of header/body pairs, a rank returns the ``done`` frames of one
wakeup as one message, and the results of one wakeup for a client that asked
(``batch_results``) as one message of result frames.  Nothing is reordered,
held back, or lost to a bad neighbour frame."""

import collections
import threading
import time

import pytest
import zmq

from zkv.broker.core import BrokerConfig, BrokerCore, ToRank, frames_of
from zkv.broker.loop import Broker
from zkv.client.client import Client
from zkv.net.endpoints import Endpoints
from zkv.net.frames import Coalescer, ready_messages, send_message
from zkv.rank.result_links import ResultSenders
from zkv.rank.worker import RankWorker
from zkv.testing.sim import CLIENT, LAYOUT
from zkv.wire import bounds
from zkv.wire import protocol as P
from zkv.wire.messages import Reply, Task


def test_the_coalescer_gathers_per_peer_and_hands_back_a_full_batch():
    c = Coalescer(limit=3)
    assert c.add(b"a", [b"h1", b"b1"]) is None
    assert c.add(b"b", [b"h2", b"b2"]) is None
    assert c.add(b"a", [b"h3", b"b3"]) is None
    assert c.add(b"a", [b"h4", b"b4"]) == [b"h1", b"b1", b"h3", b"b3", b"h4", b"b4"]  # the limit: send now
    assert c.take(b"a") is None
    assert c.drain() == [(b"b", [b"h2", b"b2"])]
    assert not c and c.drain() == []


def test_frames_helpers_keep_multipart_messages_whole(tmp_path):
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    a.bind(f"ipc://{tmp_path}/p")
    b.connect(f"ipc://{tmp_path}/p")
    try:
        a.setsockopt(zmq.SNDTIMEO, 10_000)  # the connection may not be up yet: wait for it, bounded
        send_message(a, [b"1"], block=True)
        send_message(a, [b"2", b"3", b"4"], block=True)
        assert b.poll(10_000)
        got = []
        while len(got) < 2:
            assert b.poll(10_000)
            got += list(ready_messages(b, 10))
        assert got == [[b"1"], [b"2", b"3", b"4"]]
        assert list(ready_messages(b, 10)) == []  # nothing queued: returns at once
    finally:
        a.close()
        b.close()


def registered_core(world: int = 2) -> BrokerCore:
    core = BrokerCore(BrokerConfig(world=world))
    for r in range(world):
        core.on_rank(
            f"rank-{r}".encode(),
            [P.encode("ready", rank=r, world=world, session=1, layout=LAYOUT.to_wire(), gen=0, pid=1)],
            1.0,
        )
        core.on_rank(f"rank-{r}".encode(), [P.encode("hb", inflight=0)], 1.0)  # the welcome arrived
    return core


def submit_tasks(core: BrokerCore, n: int, **fields) -> dict[bytes, list[Task]]:
    """Submit ``n`` tasks (their submits with ``fields``); the task headers each rank was sent."""
    sent: dict[bytes, list[Task]] = {}
    body = P.encode_body("swap_out", [1], [2])
    for task in range(1, n + 1):
        for a in frames_of(
            core.on_client(CLIENT, [P.encode("submit", task=task, reply_to="ipc:///x", **fields), body], 1.0), ToRank
        ):
            sent.setdefault(a.identity, []).append(P.decode(a.frames[0]))
    return sent


@pytest.mark.parametrize(
    "said, copied", [({}, None), ({"batch_results": False}, None), ({"batch_results": True}, True)]
)
def test_the_broker_copies_batch_results_into_every_ranks_header(said, copied):
    """A rank batches results only for a client that asked: the header says so
    exactly when the submit did (a header without it is the one such a client always got)."""
    sent = submit_tasks(registered_core(), 2, **said)
    headers = [h for hs in sent.values() for h in hs]
    assert len(headers) == 4 and all(h.batch_results is copied for h in headers)


def done(header: Task) -> bytes:
    return P.encode("done", seq=header.seq, n=header.n, outcome="ok", gen=0, bytes=64)


def test_a_message_of_done_frames_returns_every_credit():
    core = registered_core()
    sent = submit_tasks(core, 5)
    for identity, headers in sent.items():
        core.on_rank(identity, [done(h) for h in headers], 2.0)
    assert core.inflight == {} and core.counters["ok"] == 5
    assert all(rs.inflight == 0 for rs in core.ranks.values())


def test_a_bad_frame_in_a_batch_is_answered_and_costs_no_other_credit():
    core = registered_core()
    sent = submit_tasks(core, 3)
    for identity, headers in sent.items():
        frames = [
            done(headers[0]),
            b"\xc1junk",
            P.encode("ack", epoch=1, op="pause"),
            done(headers[1]),
            done(headers[2]),
        ]
        errors = [P.decode(a.frames[0]) for a in frames_of(core.on_rank(identity, frames, 2.0), ToRank)]
        assert [(e.kind, e.code) for e in errors] == [("error", "malformed"), ("error", "unknown_kind")]
    assert core.inflight == {} and core.counters["ok"] == 3


def test_a_batch_refuses_what_a_rank_sends_alone_even_a_ready_with_a_bad_layout():
    """Every frame of a message of several is a done (docs/protocol.md §10.3): a
    heartbeat there is not answered and a ready is not read (its bad layout would
    have the broker refuse the rank), each is ``unknown_kind``."""
    core = registered_core()
    sent = submit_tasks(core, 1)
    bad_ready = P.encode("ready", rank=0, world=2, session=2, layout={**LAYOUT.to_wire(), "layers": 0}, gen=0)
    for identity, headers in sent.items():
        frames = [done(headers[0]), P.encode("hb", probe=True), bad_ready, P.encode("ack", epoch=1, op="pause")]
        answers = [P.decode(a.frames[0]) for a in frames_of(core.on_rank(identity, frames, 2.0), ToRank)]
        assert [(a.kind, getattr(a, "code", None)) for a in answers] == [("error", "unknown_kind")] * 3
    assert core.counters["ok"] == 1 and core.rank_table.counters["refused"] == 0


def test_a_batch_over_the_cap_is_malformed_and_books_nothing():
    core = registered_core(world=1)
    (headers,) = submit_tasks(core, 1).values()
    acts = core.on_rank(b"rank-0", [done(headers[0])] * (bounds.MAX_BATCH + 1), 2.0)
    (err,) = [P.decode(a.frames[0]) for a in frames_of(acts, ToRank)]
    assert err.code == "malformed"
    assert len(core.inflight) == 1


@pytest.fixture
def endpoints(tmp_path):
    return Endpoints.in_dir(tmp_path)


def raw_socket(kind: int, address: str, bind: bool = False) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    (sock.bind if bind else sock.connect)(address)
    return sock


def recv_frames(sock: zmq.Socket, timeout_ms: int = 10_000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing arrived in time"
    return sock.recv_multipart()


def first_such(sock: zmq.Socket, wanted, timeout_s: float = 20.0) -> list[bytes]:
    """The first message for which ``wanted(frames)`` holds, skipping the
    others (heartbeats), within ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0, "the awaited message never came"
        frames = recv_frames(sock, left_ms)
        if wanted(frames):
            return frames


def is_heartbeat(frames: list[bytes]) -> bool:
    return len(frames) == 1 and P.decode(frames[0]).as_map() == {"v": 1, "kind": "hb"}


def next_message(sock: zmq.Socket, welcome_first: bool = False) -> list[bytes]:
    """The next message from the broker that is not its plain heartbeat."""
    if welcome_first:
        assert P.decode(first_such(sock, lambda f: not is_heartbeat(f))[0]).kind == "welcome"
    return first_such(sock, lambda f: not is_heartbeat(f))


def status(client: zmq.Socket, req: int) -> Reply:
    client.send(P.encode("status", req=req))
    return P.decode(recv_frames(client)[0])


def test_the_broker_sends_the_tasks_of_one_wakeup_as_one_message(endpoints, tmp_path):
    """Five tasks queue while rank 1 is missing; its registration dispatches
    all five in one wakeup: each rank gets one message of five header/body
    pairs, in submit order.  Five dones in one message end them."""
    broker = Broker(endpoints, BrokerConfig(world=2))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    ranks = [raw_socket(zmq.DEALER, endpoints.backend) for _ in range(2)]
    client = raw_socket(zmq.DEALER, endpoints.frontend)
    try:

        def register(r: int) -> None:
            ranks[r].send(P.encode("ready", rank=r, world=2, session=7, layout=LAYOUT.to_wire(), gen=0, pid=1))

        register(0)
        assert P.decode(recv_frames(ranks[0])[0]).kind == "welcome"
        body = P.encode_body("swap_out", [1], [2])
        for task in range(1, 6):
            client.send_multipart([P.encode("submit", task=task, reply_to=f"ipc://{tmp_path}/r"), body])
        assert status(client, 1).extra["queued"] == 5  # the frontend is one connection: submits came first
        register(1)
        for r, sock in enumerate(ranks):
            frames = next_message(sock, r == 1)
            headers = [P.decode(f) for f in frames[0::2]]
            assert len(frames) == 10 and [h.task for h in headers] == [1, 2, 3, 4, 5], r
            assert frames[1::2] == [body] * 5
            sock.send_multipart([done(h) for h in headers])
            sock.send(P.encode("hb", probe=True))  # answered after the dones before it on this connection
            first_such(sock, lambda f: getattr(P.decode(f[0]), "probe", None) is True)
        reply = status(client, 2)
        assert reply.extra["inflight"] == 0 and reply.extra["counters"]["ok"] == 5
    finally:
        broker.stop()
        thread.join(timeout=10)
        for s in (*ranks, client):
            s.close()


@pytest.mark.parametrize("batch_results", [False, True], ids=["one_result_per_message", "batch_results"])
def test_a_rank_runs_every_task_of_a_message_and_returns_their_dones_together(endpoints, tmp_path, batch_results):
    """... and, to a client whose submit said ``batch_results``, the results of
    that wakeup as one message of result frames, in the order the tasks ran;
    to any other client, one result per message."""
    router = raw_socket(zmq.ROUTER, endpoints.backend, bind=True)
    pub = raw_socket(zmq.PUB, endpoints.control, bind=True)
    pull = raw_socket(zmq.PULL, f"ipc://{tmp_path}/results.sock", bind=True)
    worker = RankWorker(0, 1, endpoints.backend, endpoints.control, LAYOUT, device="cpu", liveness_ms=10_000)
    # A done waits at most DONES_HOLD_S for company, which a loaded machine can
    # exceed between two 1-block fills: hold them for the whole wakeup here, so
    # what is checked is that the tasks of one message run in one wakeup.
    worker._dones.hold_s = 60.0
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        ident, frame = recv_frames(router, 20_000)
        ready = P.decode(frame)
        router.send_multipart(
            [
                ident,
                P.encode(
                    "welcome",
                    epoch=0,
                    op="run",
                    gen=0,
                    upto=0,
                    layout=LAYOUT.to_wire(),
                    heartbeat_ms=1000,
                    session=ready.session,
                ),
            ]
        )
        first_such(router, lambda f: P.decode(f[1]).kind == "hb")  # the welcome's confirmation
        tasks: list[bytes] = []
        for n in range(1, 4):
            tasks += [
                P.encode(
                    "task",
                    seq=n,
                    n=n,
                    task=100 + n,
                    reply_to=f"ipc://{tmp_path}/results.sock",
                    gen=0,
                    session=ready.session,
                    **({"batch_results": True} if batch_results else {}),
                ),
                P.encode_body("fill", dst=[n], tier="gpu", seed=n),
            ]
        router.send_multipart([ident, *tasks])
        frames = first_such(router, lambda f: P.decode(f[1]).kind != "hb")[1:]
        dones = [P.decode(f) for f in frames]
        assert [(d.kind, d.seq, d.outcome) for d in dones] == [("done", n, "ok") for n in (1, 2, 3)]
        if batch_results:
            results = [P.decode(f) for f in recv_frames(pull)]
            assert [(r.kind, r.task, r.outcome) for r in results] == [("result", t, "ok") for t in (101, 102, 103)]
        else:
            messages = [recv_frames(pull) for _ in range(3)]
            assert [len(m) for m in messages] == [1, 1, 1]
            assert [P.decode(m[0]).task for m in messages] == [101, 102, 103]
        router.send_multipart([ident, *tasks[:3]])  # an odd frame count: not a task message, counted, serving on
        router.send_multipart(
            [
                ident,
                P.encode(
                    "task",
                    seq=4,
                    n=4,
                    task=104,
                    reply_to=f"ipc://{tmp_path}/results.sock",
                    gen=0,
                    session=ready.session,
                ),
                tasks[1],
            ]
        )
        assert P.decode(recv_frames(pull)[0]).task == 104
        assert worker.core.counters["bad_broker_msgs"] == 1
    finally:
        worker.stop()
        thread.join(timeout=10)
        for s in (router, pub, pull):
            s.close()


def test_a_client_reads_every_result_of_a_message_and_drops_one_over_the_cap(endpoints, tmp_path):
    """The Python client asks for batches: a message of result frames (two
    ranks' results of one task, in one message) ends the task; a message of
    more than ``MAX_BATCH`` frames is no rank's, counted and dropped whole."""
    router = raw_socket(zmq.ROUTER, endpoints.frontend, bind=True)  # the broker, by hand
    client = Client(endpoints.frontend, reply_to=f"ipc://{tmp_path}/client.sock")
    push = raw_socket(zmq.PUSH, client.reply_to)
    try:
        body = P.encode_body("swap_out", [1], [2])
        tasks = [client.submit_raw(body, timeout=20.0) for _ in range(2)]
        submits = [P.decode(recv_frames(router)[1]) for _ in tasks]
        assert [(s.task, s.batch_results) for s in submits] == [(t, True) for t in tasks]

        def result(task: int, rank: int) -> bytes:
            return P.encode("result", task=task, rank=rank, world=2, outcome="ok", reason="", gen=0, bytes=64)

        push.send_multipart([result(tasks[1], r % 2) for r in range(bounds.MAX_BATCH + 1)])
        push.send_multipart([result(tasks[0], 0), result(tasks[0], 1)])
        out = client.wait(tasks[0], timeout=20.0)
        assert out.ok and sorted(out.per_rank) == [0, 1]
        assert client.book.counters["bad_messages"] == 1  # the over-cap message came first, on the same connection
        assert client.wait(tasks[1], timeout=0.2).outcome == "timeout"  # nothing of it was taken
    finally:
        push.close()
        client.close()
        router.close()


def test_held_results_keep_their_order_and_the_cap_per_message(tmp_path):
    """A rank's result senders: batched results wait for ``flush`` (a link that
    reaches ``MAX_BATCH`` sends at once), a result for a client that reads one per
    message goes alone, after what waited for that link; nothing is reordered,
    nothing is left held."""
    ctx = zmq.Context.instance()
    addresses = [f"ipc://{tmp_path}/r{i}.sock" for i in range(2)]
    pulls = [raw_socket(zmq.PULL, a, bind=True) for a in addresses]
    stats: collections.Counter[str] = collections.Counter()
    senders = ResultSenders(ctx, None, stats, holds=True)
    sent: dict[str, list[bytes]] = {a: [] for a in addresses}
    try:
        for i in range(bounds.MAX_BATCH + 10):
            for a in addresses:
                frame = f"{a}-{i}".encode()
                senders.post(a, None, frame, batch=i != 70)  # one result for a client that reads one per message
                sent[a].append(frame)
        assert sum(len(f) for f in senders.held.values()) == 2 * 3  # posted after the lone one
        senders.flush()
        assert not senders.held
        for a, pull in zip(addresses, pulls):
            got: list[list[bytes]] = []
            while sum(len(m) for m in got) < len(sent[a]):
                got.append(recv_frames(pull))
            assert [f for m in got for f in m] == sent[a]  # every result, in the order posted
            assert [len(m) for m in got] == [bounds.MAX_BATCH, 6, 1, 3]
        assert stats["undeliverable"] == 0
    finally:
        senders.close()
        for p in pulls:
            p.close()
