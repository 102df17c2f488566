"""Re-registration after a long outage, as the exact interleaving the
multi-host tests found (tests/test_multihost.py): the rank's READY gets
through before the broker's welcome does (each TCP direction leaves its
retransmission backoff on its own), and the rank's silence timer fires again
meanwhile.  A READY repeated with a fresh session reads as a restart at the
broker, which fails the task it had just dispatched; repeated with the same
session it is a duplicate, and the task runs."""

from zkv.testing.sim import Sim
from zkv.wire import protocol as P
from zkv.wire.messages import Ready

HB = 0.5  # the broker's and the ranks' default heartbeat


class Cable:
    """Rank 1's link to the broker: while it is down, what either side sends
    waits (TCP keeps it in its buffers) and arrives when it comes back."""

    def __init__(self, sim: Sim):
        self.sim = sim
        self.outbox: list[bytes] = []  # rank 1 -> broker, waiting

    def rank_tick(self) -> None:
        """Rank 1's own timers; what it sends waits on the cable."""
        for action in self.sim.ranks[1].core.on_tick(self.sim.now):
            self.outbox.append(action.frame)

    def deliver_to_broker(self) -> None:
        for frame in self.outbox:
            self.sim._broker_actions(self.sim.broker.on_rank(b"rank-1", [frame], self.sim.now))
        self.outbox.clear()


def step(sim: Sim, cable: Cable, dt: float) -> None:
    """``dt`` passes: both cores' timers run, rank 0's link works, rank 1's waits."""
    sim.now += dt
    sim._rank_actions(0, sim.ranks[0].core.on_tick(sim.now))
    cable.rank_tick()
    sim.tick(0)  # the broker's timers
    sim.deliver_broker()
    sim.deliver_dealer(0)
    sim.deliver_pub(0)
    sim.finish(0)


def readies(frames: list[bytes]) -> list[Ready]:
    return [m for m in map(P.decode, frames) if m.kind == "ready"]


def test_a_ready_repeated_before_its_welcome_arrives_keeps_the_session_and_the_task_succeeds():
    sim = Sim().up()
    cable = Cable(sim)
    old_session = sim.ranks[1].core.registration.session
    # The link goes down.  Both sides time out: the broker declares rank 1
    # dead, rank 1 registers again (a fresh session: it had been registered).
    while sim.broker.ranks[1].alive or not cable.outbox:
        step(sim, cable, HB / 5)
        assert sim.now < 110, "neither side noticed the outage"
    first = readies(cable.outbox)[0]
    assert first.session != old_session and not sim.ranks[1].core.registered
    task = sim.submit()  # queued: rank 1 is dead
    for _ in range(8):  # the outage lasts 1.6 s more (4-5 s in all, as in the multi-host test)
        step(sim, cable, HB / 5)
    sim.ranks[1].dealer_in.clear()  # what the broker sent the old registration is lost with it
    # rank 1 -> broker recovers first: the READY gets through and the broker
    # welcomes rank 1; broker -> rank 1 is still in backoff.
    cable.deliver_to_broker()
    assert sim.broker.ranks[1].alive and sim.broker.ranks[1].session == first.session
    kinds = [P.decode(frames[0]).kind for frames in sim.ranks[1].dealer_in]
    # a reregister for each heartbeat it sent during the outage (stale by now),
    # then a welcome for each of its READYs; the task waits until the rank
    # shows it has its welcome (that connection's way back may be dead)
    assert "welcome" in kinds and set(kinds) == {"reregister", "welcome"}, kinds
    # Rank 1 has still heard nothing: its timers fire again and it repeats its READY.
    # (rank 1 -> broker works now: what it sends arrives.)
    again = []
    for _ in range(int(sim.ranks[1].core.registration.liveness_ms / 1000 / (HB / 5)) + 2):
        step(sim, cable, HB / 5)
        again += readies(cable.outbox)
        cable.deliver_to_broker()
    assert again, "an unanswered READY is repeated"
    # Now everything flows: the welcome (and its duplicates) and the task reach rank 1.
    sim.settle()
    assert sim.outcomes[task] == "ok", [m for m in sim.client_in if m.kind == "outcome"]
    assert {m.session for m in again} == {first.session}, "a repeated READY keeps its session"
    assert sim.broker.counters["duplicate_ready"] >= 1
    assert sim.ranks[1].core.registered and sim.ranks[1].core.registration.session == first.session
    # and the bus still pauses with the exact count: the duplicate welcomes
    # came after the task on the same connection and say so (upto).
    req = sim.request("pause")
    sim.settle()
    assert sim.reply(req).extra["state"] == "paused" and sim.reply(req).extra["ranks_acked"] == 2


def test_a_registered_rank_that_loses_the_broker_takes_a_fresh_session_and_keeps_it_until_welcomed():
    sim = Sim().up()
    core = sim.ranks[1].core
    registered = core.registration.session
    t = sim.now
    readies_sent = []
    for i in range(1, 40):  # 4 s of silence from the broker
        readies_sent += [P.decode(a.frame) for a in core.on_tick(t + i * 0.1) if P.decode(a.frame).kind == "ready"]
    assert len(readies_sent) >= 2
    sessions = {m.session for m in readies_sent}
    assert len(sessions) == 1 and registered not in sessions


def test_a_welcome_repeated_after_tasks_sets_the_received_count_from_its_upto():
    """Duplicate READYs get duplicate welcomes, each after the tasks already
    dispatched on the same connection: resetting the count to 0 there would
    make a pause wait for tasks that arrived long ago."""
    sim = Sim().up()
    sim.submit()
    sim.settle()
    core = sim.ranks[1].core
    # The rank repeats its READY (same session), the broker answers a duplicate.
    frame = P.encode(
        "ready", rank=1, world=2, session=core.registration.session, layout=core.layout.to_wire(), gen=core.gen, pid=0
    )
    sim._broker_actions(sim.broker.on_rank(b"rank-1", [frame], sim.now))
    assert sim.broker.counters["duplicate_ready"] == 1
    sim.deliver_dealer(1)
    assert core.received == 1
    req = sim.request("pause")
    sim.settle()
    assert sim.reply(req).extra["state"] == "paused"


def test_a_welcome_naming_tasks_that_never_came_makes_the_rank_register_afresh():
    """The connection died with the broker's first welcome and a task on it; the
    welcome answering a repeated READY came on the new one and counts that task
    (upto).  The rank cannot run it: a new session makes the broker fail it
    at once, rather than wait for a done that never comes."""
    sim = Sim().up()
    core = sim.ranks[1].core
    old = core.registration.session
    acts = core.on_broker(
        P.encode(
            "welcome", epoch=0, op="run", gen=0, upto=1, layout=core.layout.to_wire(), heartbeat_ms=500, session=old
        ),
        sim.now,
    )
    (ready,) = [P.decode(a.frame) for a in acts if P.decode(a.frame).kind == "ready"]
    assert ready.session != old and not core.registered and core.counters["tasks_lost_in_transit"] == 1


def test_a_rank_back_from_an_outage_gets_tasks_only_once_it_shows_its_welcome_arrived():
    sim = Sim().up()
    sim.tick(3.0)  # both ranks silent: dead
    for r in (0, 1):
        sim._rank_actions(r, sim.ranks[r].core.on_tick(sim.now))
    sim.deliver_broker()
    task = sim.submit()
    assert all(sr.dealer_in and all(P.decode(f[0]).kind != "task" for f in sr.dealer_in) for sr in sim.ranks.values())
    sim.settle()  # the welcomes arrive, each rank says so with a heartbeat, the task goes out
    assert sim.outcomes[task] == "ok"
