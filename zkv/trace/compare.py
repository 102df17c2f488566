"""Compare the recorded outcomes of two traces (``zkv trace diff``)."""

from __future__ import annotations

import collections
from typing import Any

from .format import TaskSpec, Trace


def outcome_table(trace: Trace) -> dict[tuple[int, int], tuple[list[str], int]]:
    """(client rank, task index) -> (recorded outcome sequence, submit line).

    Clients are matched by what they submit, not by name (a recording names
    clients by ZMQ identity): a client's signature is its sequence of task
    bodies; clients with equal signatures are told apart by first appearance.
    """
    by_client: dict[str, list[TaskSpec]] = collections.defaultdict(list)
    for spec in sorted(trace.tasks.values(), key=lambda s: s.index):
        by_client[spec.key[0]].append(spec)
    bodies = {op.key: op.body for op in trace.submits()}
    clients = sorted(by_client, key=lambda c: (tuple(bodies[s.key] for s in by_client[c]), by_client[c][0].index))
    table = {}
    for ci, client in enumerate(clients):
        for ti, spec in enumerate(by_client[client]):
            table[(ci, ti)] = ([o for _, o in spec.recorded], spec.line)
    return table


def compare_outcomes(a: Trace, b: Trace) -> list[dict[str, Any]]:
    """Tasks whose recorded outcome sequences differ between two traces."""
    ta, tb = outcome_table(a), outcome_table(b)
    bodies_a = {op.key: op.body for op in a.submits()}
    bodies_b = {op.key: op.body for op in b.submits()}
    if sorted(bodies_a.values()) != sorted(bodies_b.values()):
        return [
            {
                "kind": "different_tasks",
                "lines_a": [],
                "lines_b": [],
                "message": f"the traces do not submit the same tasks "
                f"({len(bodies_a)} vs {len(bodies_b)} submits, or different bodies)",
            }
        ]
    diffs = []
    for k in sorted(set(ta) | set(tb)):
        (oa, la), (ob, lb) = ta.get(k, ([], 0)), tb.get(k, ([], 0))
        if oa != ob:
            diffs.append(
                {
                    "kind": "different_outcomes",
                    "lines_a": [la],
                    "lines_b": [lb],
                    "message": f"{a.source} line {la}: {oa or 'no outcome'} "
                    f"but {b.source} line {lb}: {ob or 'no outcome'}",
                }
            )
    return diffs
