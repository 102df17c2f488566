"""Model-based test of the whole bus: hypothesis drives BrokerCore,
N RankCores and the client's ResultBook (tests/model_bus.py) through client
requests, rank registration / death / freeze / restart, broker restarts at any
moment (zero ranks too), lost PUB messages, reordering between connections and
clock jumps, and checks after every step: one outcome per task, no copy between
a pause ack and the next resume, every request answered by its deadline, one
layout and generation among serving ranks, no silent loss, no internal error.

CI runs a bounded number of examples; ``ZKV_LONG_MODEL=1`` runs the long profile.
"""

import os

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from model_bus import ALLOC_LIMIT, LAYOUT, OTHER, Bus

from zkv.wire import bounds
from zkv.wire import protocol as P

LONG = os.environ.get("ZKV_LONG_MODEL") == "1"
# That the bus still recovers (no wedge) is probed at the end of every example,
# and in the long profile after every step too (on a copy, tens of ms a probe).
PROBE_EVERY = 1 if LONG else 0  # 0: at the end of every example only
WORLD = st.integers(0, 2)  # a rank index (the machine's world is 2 or 3)


def edges(*points: int) -> st.SearchStrategy[int]:
    """Integers at and around each bound of docs/protocol.md §2.1."""
    return st.sampled_from(sorted({p + d for p in points for d in (-1, 0, 1) if p + d >= -1}))


GENS = edges(0, bounds.MAX_ADOPTED_GEN, bounds.MAX_GEN)
UINTS = edges(0, P.MAX_SAFE_INT)
TIMEOUTS = edges(0, bounds.MAX_TIMEOUT_MS)
IDS = edges(0, LAYOUT.gpu_blocks, 2**31 - 1).filter(lambda i: i < 2**31)
LAYOUT_EDGES = st.sampled_from(
    [
        {"layers": bounds.MAX_LAYERS},
        {"layers": bounds.MAX_LAYERS + 1},
        {"layers": 0},
        {"gpu_blocks": 2**31 - 1},
        {"gpu_blocks": 2**31},
        {"block_size": bounds.LAYOUT_MAX["block_size"], "head_dim": bounds.LAYOUT_MAX["head_dim"]},
        {"kv_heads": bounds.LAYOUT_MAX["kv_heads"] + 1},
        {"gpu_blocks": None},
        {"dtype": "fp32"},
    ]
)
REPLY_TO = st.sampled_from(
    ["ipc:///stranger", "tcp://[::1]:5555", "tcp://::1:5555", "tcp://0.0.0.0:5555", "tcp://127.0.0.1:05555", "ipc://"]
)


class BusModel(RuleBasedStateMachine):
    @initialize(
        world=st.sampled_from([2, 3]),
        boot=st.booleans(),
        first_task=st.sampled_from([1, P.MAX_SAFE_INT - 500]),
        stranger_gen=st.one_of(st.none(), GENS),
    )
    def setup(self, world, boot, first_task, stranger_gen):
        self.bus = Bus(world)
        self.bus.next_task = first_task  # task ids up to the top of the uint range
        self.steps = 0
        if stranger_gen is not None:  # a stranger registers before any rank: the broker may adopt its gen
            ready = {"rank": 0, "world": world, "session": 1, "layout": LAYOUT.to_wire(), "gen": stranger_gen}
            self.bus.stranger_rank([_map("ready", **ready)])
        if boot:  # else the first requests may meet a broker with no rank registered
            self.everything_delivered()

    def _rank(self, r: int) -> int:
        return r % self.bus.world

    # --- the client ---------------------------------------------------------------

    @rule(tier=st.sampled_from(["gpu", "cpu"]), block=st.integers(0, 7), seed=st.integers(1, 5))
    def fill(self, tier, block, seed):
        if (tier, block) not in self.bus.busy_blocks():
            self.bus.submit("fill", tier, [block], seed)

    @rule(tier=st.sampled_from(["gpu", "cpu"]), block=st.integers(0, 7))
    def checksum(self, tier, block):
        if (tier, block) not in self.bus.busy_blocks():
            self.bus.submit("checksum", tier, [block])

    @rule(timeout_ms=st.one_of(st.sampled_from([300, 1500]), TIMEOUTS.filter(lambda t: t >= 0)))
    def pause(self, timeout_ms):
        self.bus.request("pause", timeout_ms)

    @rule(keep_cpu=st.booleans())
    def clear(self, keep_cpu):
        self.bus.request("clear", keep_cpu=keep_cpu)

    @rule(layout=st.sampled_from([None, None, "other", "base", "huge", "edge"]), edge=LAYOUT_EDGES)
    def resume(self, layout, edge):
        fields = {}
        if layout == "edge":  # a layout field at or just past its bound (§4.8)
            fields["layout"] = edge
        elif layout == "other":
            fields["layout"] = {"gpu_blocks": OTHER.gpu_blocks, "cpu_blocks": OTHER.cpu_blocks}
        elif layout == "base":
            fields["layout"] = {"gpu_blocks": 8, "cpu_blocks": 8}
        elif layout == "huge":
            fields["layout"] = {"gpu_blocks": ALLOC_LIMIT + 1}
        self.bus.request("resume", **fields)

    @rule(r=WORLD, layout=st.sampled_from(["other", "base"]))
    def resume_while_a_rank_is_frozen(self, r, layout):
        """Recovery sequence 2 (test_recovery_e2e.py) in one step: a layout-changing resume reaches some
        ranks, one is frozen past the liveness window, the resume fails."""
        bus, r = self.bus, self._rank(r)
        target = OTHER if layout == "other" else None
        fields = (
            {"layout": {"gpu_blocks": target.gpu_blocks, "cpu_blocks": target.cpu_blocks}}
            if target
            else {"layout": {"gpu_blocks": 8, "cpu_blocks": 8}}
        )
        for op in ("pause", "clear"):  # from a cleared bus, as an operator would
            bus.request(op)
            bus.settle()
        bus.ranks[r].frozen = True
        bus.request("resume", timeout_ms=1500, **fields)
        bus.settle()
        bus.advance(1.2)
        bus.settle()
        bus.thaw(r)

    @rule()
    def status(self):
        self.bus.request("status")

    @rule(n=st.integers(1, 4))
    def client_reads(self, n):
        for _ in range(n):
            self.bus.deliver_client()

    @rule(r=WORLD)
    def client_reads_results(self, r):
        self.bus.deliver_result(self._rank(r))

    # --- strangers: in-bound values at every bound -------------------------------------

    @rule(
        kind=st.sampled_from(["ready", "done", "ack", "batch"]),
        rank=edges(0, 2, bounds.MAX_WORLD - 1),
        gen=GENS,
        n=UINTS,
        world_ok=st.booleans(),
    )
    def stranger_rank(self, kind, rank, gen, n, world_ok):
        """A backend peer the model does not run: a ready at the edge of the
        generation range (it may register, then falls silent), or dones and
        acks from an identity no rank holds."""
        bus = self.bus
        if kind == "ready":
            fields = {"rank": rank, "world": bus.world if world_ok else bounds.MAX_WORLD + 1, "session": n}
            frames = [_map("ready", layout=LAYOUT.to_wire(), gen=gen, **fields)]
        elif kind == "ack":
            frames = [_map("ack", epoch=n, op="resume", gen=gen, layout=LAYOUT.to_wire())]
        else:
            frames = [_map("done", seq=n, n=n, outcome="ok", gen=gen)] * (3 if kind == "batch" else 1)
        bus.stranger_rank(frames)

    @rule(
        kind=st.sampled_from(["ping", "status", "submit", "kind", "version"]),
        value=UINTS,
        timeout_ms=TIMEOUTS,
        wait=edges(0, bounds.MAX_WORLD),
        reply_to=REPLY_TO,
        block=IDS,
        op=st.sampled_from(["checksum", "fill"]),
    )
    def stranger_client(self, kind, value, timeout_ms, wait, reply_to, block, op):
        """Another client, with every integer at a bound: it reads, pings and
        names blocks no rank holds (its writes would change what the model's client wrote)."""
        if kind == "ping":
            frames = [_map("ping", req=value)]
        elif kind == "status":
            frames = [_map("status", req=1, wait_ranks=wait, timeout_ms=timeout_ms)]
        elif kind == "submit":
            if op == "fill" and 0 <= block < max(LAYOUT.gpu_blocks, OTHER.gpu_blocks) * 1000:
                block = -1  # a write only where no rank holds a block
            key = "dst" if op == "fill" else "src"
            body = _map("body", op=op, tier="gpu", **{key: [block]})
            frames = [_map("submit", task=value, reply_to=reply_to, timeout_ms=timeout_ms), body]
        elif kind == "kind":
            frames = [_map("k" * 5000, req=value)]
        else:
            frames = [_map("ping", req=1, v="v" * 5000)]
        self.bus.stranger_client(frames)

    # --- the network ----------------------------------------------------------------

    @rule(r=WORLD, n=st.integers(1, 4))
    def rank_to_broker(self, r, n):
        for _ in range(n):
            self.bus.deliver_broker(self._rank(r))

    @rule(r=WORLD, n=st.integers(1, 4))
    def broker_to_rank(self, r, n):
        for _ in range(n):
            self.bus.deliver_dealer(self._rank(r))

    @rule(r=WORLD, lose=st.booleans())
    def pub_to_rank(self, r, lose):
        self.bus.deliver_pub(self._rank(r), lose)

    @rule(r=WORLD, n=st.integers(1, 3))
    def executor_runs(self, r, n):
        for _ in range(n):
            self.bus.execute(self._rank(r))

    @rule()
    def everything_delivered(self):
        """Drain every queue until nothing moves (a quiet moment of a real bus)."""
        self.bus.settle()

    @rule(tier=st.sampled_from(["gpu", "cpu"]), block=st.integers(0, 7), seed=st.integers(1, 5))
    def write_then_read(self, tier, block, seed):
        """A fill and a checksum of the same block, each delivered in full: the
        checksum is then checked against what the client wrote."""
        for op in ("fill", "checksum"):
            if (tier, block) in self.bus.busy_blocks():
                return
            self.bus.submit(op, tier, [block], seed)
            self.bus.settle()

    # --- processes and the clock ------------------------------------------------------

    @rule(r=WORLD)
    def kill_rank(self, r):
        self.bus.kill_rank(self._rank(r))

    @rule(r=WORLD)
    def start_rank(self, r):
        r = self._rank(r)
        if not self.bus.ranks[r].alive:
            self.bus.start_rank(r)

    @rule(r=WORLD)
    def restart_rank(self, r):
        r = self._rank(r)
        self.bus.kill_rank(r)
        self.bus.start_rank(r)

    @rule(r=WORLD)
    def freeze(self, r):
        self.bus.ranks[self._rank(r)].frozen = True

    @rule(r=WORLD)
    def thaw(self, r):
        self.bus.thaw(self._rank(r))

    @rule()
    def restart_broker(self):
        self.bus.restart_broker()

    @rule(dt=st.sampled_from([0.01, 0.05, 0.1, 0.3]))
    def tick(self, dt):
        self.bus.advance(dt)

    @rule(dt=st.sampled_from([1.5, 5.0]))
    def clock_jump(self, dt):
        self.bus.advance(dt)

    @invariant()
    def rules_hold(self):
        if hasattr(self, "bus"):
            self.bus.check()
            self.steps += 1
            if PROBE_EVERY and self.steps % PROBE_EVERY == 0:
                self.recovers()

    def recovers(self, on_copy: bool = True):
        why = self.bus.recovers(on_copy)
        assert why is None, f"the bus is wedged: {why}"

    def teardown(self):
        if hasattr(self, "bus"):
            self.recovers(on_copy=False)


def _map(kind: str, v: object = 1, **fields) -> bytes:
    """A frame as a stranger writes it: any value, no encoder checks."""
    return msgpack.packb({"v": v, "kind": kind, **fields}, use_bin_type=True)


BusModel.TestCase.settings = settings(
    max_examples=2000 if LONG else 100,
    stateful_step_count=100 if LONG else 50,
    phases=[
        Phase.explicit,
        Phase.reuse,
        Phase.generate,
        Phase.shrink,
    ],  # no tracing "explain" phase: slow on a loaded machine
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=not LONG,
)
# pytest-timeout's 120 s default is too tight for a shared, loaded CI machine
# (about 5 s alone); the long profile runs for minutes and has no bound.
test_bus_model = pytest.mark.timeout(0 if LONG else 600)(BusModel.TestCase)


def test_a_layout_no_rank_can_allocate_backs_off_shows_in_status_and_a_pause_takes_over_its_retries(caplog):
    """A resume that completes with no rank registered makes its layout the
    bus's; every rank that registers fails the broker's own resume: it is
    retried backed off, status says why, and a pause is answered, never busy."""
    bus = Bus(2)
    bus.settle()
    for r in (0, 1):
        bus.kill_rank(r)
    for _ in range(15):  # past the liveness window: no rank registered
        bus.advance(0.1)
        bus.settle()
    for kind, fields in (("pause", {}), ("clear", {}), ("resume", {"layout": {"gpu_blocks": ALLOC_LIMIT + 1}})):
        req = bus.request(kind, **fields)
        bus.settle()
        assert bus.replies[req].kind == "reply"
    for r in (0, 1):
        bus.start_rank(r)
    tries = []
    for _ in range(80):  # 8 s of bus time
        bus.advance(0.1)
        bus.settle()
        st = bus.broker.status(bus.now)
        if not tries or st["restate_failures"] != tries[-1][1]:
            tries.append((bus.now, st["restate_failures"]))
    failures = bus.broker.status(bus.now)["restate_failures"]
    assert 3 <= failures <= 7, f"{failures} failed tries in 8 s: not backed off"
    gaps = [b[0] - a[0] for a, b in zip(tries[1:], tries[2:])]
    assert all(later > earlier for earlier, later in zip(gaps, gaps[1:])), f"retries not backed off: {gaps}"
    st = bus.broker.status(bus.now)
    assert st["state"] == "resuming" and "alloc_failed" in st["restate_error"] and "zkv pause" in st["restate_error"]
    for _ in range(400):  # up to 10 s, to the worst moment: the broker's own resume just began
        bus.advance(0.025)
        if bus.broker.pending is not None:
            break
        bus.settle()
    assert bus.broker.pending is not None and bus.broker.pending.op == "resume" and not bus.broker.pending.waiters
    req = bus.pause_within(3.0)
    assert bus.replies[req].kind == "reply" and bus.broker.state == "paused", bus.replies[req]
    for _ in range(40):
        bus.advance(0.1)
        bus.settle()
    assert bus.broker.status(bus.now)["restate_failures"] == failures, "the broker retried behind the pause"
    logged = [r for r in caplog.records if "the broker's own resume failed" in r.getMessage()]
    assert len(logged) == failures and not any(r.exc_info for r in logged), "one line per failure, no traceback"
    assert bus.broker.state == "paused"
