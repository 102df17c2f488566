"""WaiterBook (held status requests): its bounds hold whatever clients do."""

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from zkv.broker.waiters import Waiter, WaiterBook

steps = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 5), st.integers(1, 3), st.floats(0, 10)),
        st.tuples(st.just("settle"), st.integers(0, 3), st.floats(0, 10)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_bounds_fairness_and_expiry(ops):
    book = WaiterBook(per_client=4, total=10)
    req = 0
    for op in ops:
        if op[0] == "admit":
            _, client, want, deadline = op
            req += 1
            before = collections.Counter(w.client for w in book.held)
            held, evicted = book.admit(Waiter(bytes([client]), req, want, deadline))
            if before[bytes([client])] >= 4:
                assert not held
            if evicted is not None:  # only from a connection that held more than this one
                assert held and before[evicted.client] > before[bytes([client])]
                assert all(w.req > evicted.req for w in book.held if w.client == evicted.client)  # its oldest
            if not held:
                assert sum(before.values()) >= 10 or before[bytes([client])] >= 4
        else:
            _, ready, now = op
            met, expired = book.settle(now, ready)
            assert all(ready >= w.want for w in met) and all(now >= w.deadline and ready < w.want for w in expired)
            assert all(ready < w.want and now < w.deadline for w in book.held)
        counts = collections.Counter(w.client for w in book.held)
        assert counts == +book.count
        assert len(book.held) <= 10 and max(counts.values(), default=0) <= 4
        assert book.due == min((w.deadline for w in book.held), default=float("inf"))
