"""A clear names the weights served after it (docs/protocol.md §8.2, "Whose
weights"): status says the name until the next clear without keep_cpu, a
restarted broker keeps it, a clear that keeps the CPU tier may not name any,
and bad names are refused where they enter; on the sans-IO broker and on a
real bus."""

import pytest

from zkv.broker.core import BrokerConfig, BrokerCore, ToClient
from zkv.broker.state_file import check_snapshot
from zkv.client.client import Client
from zkv.testing.sim import Sim
from zkv.wire import protocol as P
from zkv.wire.errors import ZkvError


def replies(actions):
    return [P.decode(a.frames[0]) for a in actions if isinstance(a, ToClient)]


def ask(core: BrokerCore, kind: str, req: int, **fields):
    (reply,) = replies(core.on_client(b"c", [P.encode(kind, req=req, **fields)], 1.0))
    return reply


def cleared_under(sim: Sim, **fields) -> None:
    for kind, named in (("pause", {}), ("clear", fields), ("resume", {})):
        req = sim.request(kind, **named)
        sim.settle()
        assert sim.reply(req).kind == "reply", sim.reply(req)


def test_status_says_the_name_the_last_clear_without_keep_cpu_gave_the_weights():
    sim = Sim().up()
    gens = sim.broker.gens
    assert gens.weights is None
    cleared_under(sim, weights="step-7")
    assert gens.weights == "step-7" and sim.broker.status_answer(1, 0.0).weights == "step-7"
    cleared_under(sim, keep_cpu=True)
    assert gens.weights == "step-7", "a clear that keeps the CPU tier keeps the weights its blocks are of"
    cleared_under(sim)
    assert gens.weights is None, "a clear that names none: weights no name was given"


def test_a_clear_that_keeps_the_cpu_tier_and_names_weights_is_refused_and_changes_nothing():
    core = BrokerCore(BrokerConfig(world=2))
    assert ask(core, "pause", 1).kind == "reply"
    gen = core.gens.gen
    refused = ask(core, "clear", 2, keep_cpu=True, weights="step-8")
    assert refused.kind == "error" and refused.code == "bad_field" and "keep" in refused.reason
    assert core.gens.gen == gen and core.gens.weights is None and core.control.state == "paused"


@pytest.mark.parametrize("name", ["", "x" * 257, "step\n9", 7])
def test_a_bad_name_is_refused_where_it_enters(name):
    core = BrokerCore(BrokerConfig(world=2))
    assert ask(core, "pause", 1).kind == "reply"
    refused = ask(core, "clear", 2, weights=name)
    assert refused.kind == "error" and core.gens.weights is None and core.control.state == "paused"


def test_a_cleared_bus_takes_a_new_name_and_a_restarted_broker_keeps_it():
    core = BrokerCore(BrokerConfig(world=2))
    assert ask(core, "pause", 1).kind == "reply"
    assert ask(core, "clear", 2, weights="a").extra["state"] == "cleared"
    assert ask(core, "clear", 3, weights="b").extra.get("noop") is True
    assert core.gens.weights == "b", "nothing of any weights is held: the name is taken"
    snap = check_snapshot(core.recovery.snapshot())
    again = BrokerCore(BrokerConfig(world=2))
    again.recovery.restore(snap)
    assert again.gens.weights == "b"
    with pytest.raises(ValueError, match="weights"):
        check_snapshot({**snap, "weights": ["not", "a", "name"]})


def test_a_real_broker_names_the_weights_through_the_client(tmp_path):
    from test_engine_geometry import BrokerThread

    with BrokerThread(tmp_path) as b, Client(b.endpoints.frontend) as c:
        c.pause(timeout=10)
        c.clear(timeout=10, weights="step-42")
        assert c.status(timeout=10).weights == "step-42"
        with pytest.raises(ZkvError, match="keep") as refused:
            c.clear(keep_cpu=True, timeout=10, weights="step-43")
        assert refused.value.code == "bad_field"
        with pytest.raises(ZkvError):
            c.clear(timeout=10, weights="x" * 257)
        assert c.status(timeout=10).weights == "step-42", "a refused clear changes nothing"
