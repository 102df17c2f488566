"""The cycle's record on an engine's label (zkv/cycle/label.py): data written
and read back whole, every field range-checked where it is read, and nothing
an engine's label says taken for a record it is not."""

from __future__ import annotations

import base64

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zkv.cycle.label import PREFIX, VERSION, CycleRecord, LabelError, decode, encode, is_record
from zkv.cycle.terms import Phase

ids = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
labels = st.none() | st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=256).filter(
    str.isprintable
)
records = st.builds(
    CycleRecord,
    cycle=ids,
    phase=st.sampled_from(Phase),
    old=labels,
    new=labels,
    host=st.from_regex(r"[a-z0-9.-]{1,64}", fullmatch=True),
    pid=st.integers(1, 2**22),
    until=st.integers(0, 2**40),
)


@given(records)
def test_a_record_reads_back_as_written(record):
    text = encode(record)
    assert text.startswith(PREFIX + VERSION) and is_record(text)
    assert decode(text) == record


@given(st.text(max_size=300))
def test_any_label_is_a_record_or_not_and_never_breaks_the_reader(text):
    try:
        found = decode(text)
    except LabelError:
        assert is_record(text)
        return
    assert found is None or is_record(text)


@pytest.mark.parametrize("label", [None, "", "default", "w1", "zkv-cycle-done:step-1", "step-42"])
def test_an_engines_own_label_is_no_record(label):
    assert decode(label) is None


def _raw(*fields) -> str:
    body = base64.urlsafe_b64encode(msgspec.msgpack.encode(list(fields))).decode().rstrip("=")
    return PREFIX + VERSION + body


@pytest.mark.parametrize(
    "text,complaint",
    [
        (_raw("c1", "claimed", None, None, "h", 0, 10), "pid"),
        (_raw("c1", "claimed", None, None, "h", 1, 2**41), "until"),
        (_raw("bad id!", "claimed", None, None, "h", 1, 10), "cycle id"),
        (_raw("c1", "dreaming", None, None, "h", 1, 10), "does not decode"),
        (_raw("c1", "claimed", "x" * 300, None, "h", 1, 10), "old label"),
        (_raw("c1", "claimed", None, None, "", 1, 10), "host"),
        (_raw("c1", "claimed", None, None, "h", True, 10), "does not decode"),
        (_raw("c1", "claimed", None, None, "h", 1, 10, "more"), "does not decode"),
        (PREFIX + "v2.AAAA", "another version"),
        (PREFIX + VERSION + "%%%", "does not decode"),
        (PREFIX + VERSION + "A" * 5000, "longer"),
    ],
)
def test_a_record_that_does_not_check_is_refused_naming_why(text, complaint):
    with pytest.raises(LabelError, match=complaint):
        decode(text)


def test_a_record_is_written_only_when_it_checks():
    with pytest.raises(LabelError):
        encode(CycleRecord("c1", Phase.CLAIMED, None, None, "host", 0, 1))
