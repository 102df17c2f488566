"""The kinds each socket receives (docs/protocol.md §3's table, §4's
directions): a socket's one decoder is made from its set (``fast.decoder``),
and a kind its set does not name is refused there (``unknown_kind``).

A message of several frames narrows its set: every frame of a rank's
message of ``done`` frames is a ``done``, and the first of each pair of a
broker's message of tasks a ``task`` header (docs/protocol.md §10.3).
"""

from __future__ import annotations

#: broker ROUTER "frontend", from a client's DEALER (§4.1)
BROKER_FRONTEND = ("submit", "pause", "clear", "resume", "status", "ping", "cancel")
#: broker ROUTER "backend", from a rank's DEALER: a message of one frame (§4.4)
BROKER_BACKEND = ("ready", "hb", "done", "ack")
#: every frame of a rank's message of several (§10.3)
BATCHED_DONE = ("done",)
#: rank DEALER, from the broker's backend: a message of one frame (§4.5)
RANK_DEALER = ("welcome", "refused", "reregister", "hb", "error", "task")
#: the header of each header / body pair of a message of tasks (§4.5, §10.3)
TASK_HEADER = ("task",)
#: rank SUB, from the broker's PUB "control" (§4.6); a bus view listens there too
RANK_SUB = ("control",)
#: client DEALER, from the broker's frontend (§4.2)
CLIENT_DEALER = ("reply", "error", "outcome")
#: client PULL, from the ranks' PUSH (§4.3)
CLIENT_PULL = ("result",)

#: every socket's set, by name (a test holds them to the message classes and the doc)
SOCKETS: dict[str, tuple[str, ...]] = {
    "broker frontend": BROKER_FRONTEND,
    "broker backend": BROKER_BACKEND,
    "rank dealer": RANK_DEALER,
    "rank sub": RANK_SUB,
    "client dealer": CLIENT_DEALER,
    "client pull": CLIENT_PULL,
}
