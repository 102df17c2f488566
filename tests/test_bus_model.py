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

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from model_bus import ALLOC_LIMIT, OTHER, Bus

LONG = os.environ.get("ZKV_LONG_MODEL") == "1"
WORLD = st.integers(0, 2)  # a rank index (the machine's world is 2 or 3)


class BusModel(RuleBasedStateMachine):
    @initialize(world=st.sampled_from([2, 3]), boot=st.booleans())
    def setup(self, world, boot):
        self.bus = Bus(world)
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

    @rule(timeout_ms=st.sampled_from([300, 1500]))
    def pause(self, timeout_ms):
        self.bus.request("pause", timeout_ms)

    @rule(keep_cpu=st.booleans())
    def clear(self, keep_cpu):
        self.bus.request("clear", keep_cpu=keep_cpu)

    @rule(layout=st.sampled_from([None, None, "other", "base", "huge"]))
    def resume(self, layout):
        fields = {}
        if layout == "other":
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
        bus.ranks[r].frozen = False

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
        self.bus.ranks[self._rank(r)].frozen = False

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
