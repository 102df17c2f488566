"""The documentation is executed: every shell block of README.md and docs/*.md is
run as a user would run it (tests/doc_runner.py), with the output lines its
markers document checked, and every command line of every block, run or
not, is parsed by the real CLI (tests/doc_check.py).  The markers are
described in tests/doc_blocks.py.  Every file and module the docs, and every
docstring and comment under zkv/, name exists (tests/doc_refs.py).

Blocks marked ``long`` (demos and replays on embedded clusters, a minute or
more on 2 cores) run only with ``ZKV_DOCS_LONG=1``; without it they are
parse-checked only and their run test skips saying so.
"""

from __future__ import annotations

import os

import pytest
from doc_blocks import DocError, all_blocks, doc_files, parse, shell_blocks
from doc_check import check_command, check_inline, check_zkv, inline_commands
from doc_refs import ROOT, dangling, dangling_in_code, dangling_in_docs
from doc_runner import BlockRun

LONG = os.environ.get("ZKV_DOCS_LONG") == "1"
SHELL = shell_blocks()


def test_every_doc_block_and_marker_is_understood():
    blocks = all_blocks()
    assert len(SHELL) >= 10, [b.id for b in SHELL]
    files = {b.file for b in blocks if b.file}
    assert {"/etc/zkv/broker.env", "/etc/systemd/system/zkv-broker.service"} <= files, files
    # A block a user runs is marked as one: an unlabelled block that starts with a command is a drift
    # (one that starts with "zkv up: ..." is what zkv printed).
    for b in blocks:
        words = b.body[0].split()[:2] if b.body else []
        if b.lang == "" and words[:1] in (["zkv"], ["python"], ["PYTHONPATH=."]) and not words[-1].endswith(":"):
            pytest.fail(f"{b.id}: a command in a block without a language (label it sh)")
    # A block runs in a scratch directory: a path into the checkout needs its {root} substitution.
    for b in SHELL:
        if (
            b.reason("skip") is None
            and any(".venv-vllm/" in line for line in b.body)
            and not any(m.args[0] == ".venv-vllm" for m in b.named("sub"))
        ):
            pytest.fail(f'{b.id}: names .venv-vllm/ without <!-- zkv-doc: sub ".venv-vllm" "{{root}}/.venv-vllm" -->')


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_commands_parse(block):
    checked = [c for command in block.commands() for c in check_command(command)]
    if block.reason("skip") is None and block.commands():
        assert checked or all(not c.command.startswith(("zkv", "python")) for c in block.commands())


def test_every_zkv_command_and_option_the_prose_names_exists():
    spans = [(p.name, span) for p in doc_files() for span in inline_commands(p.read_text(encoding="utf-8"))]
    assert len(spans) > 50, spans
    for name, span in spans:
        try:
            check_inline(span)
        except AssertionError as err:
            pytest.fail(f"{name}: {err}")
    with pytest.raises(AssertionError, match="no option --no-such"):
        check_inline("zkv trace gen/check --no-such")
    with pytest.raises(AssertionError, match="no command"):
        check_inline("zkv frobnicate")


def test_every_file_and_module_the_docs_and_docstrings_name_exists():
    """README.md, docs/*.md and every docstring and comment under zkv/ (tests/doc_refs.py)."""
    problems = [*dangling_in_docs(), *dangling_in_code()]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("see ``zkv/prefix/gone.py``", "zkv/prefix/gone.py`` names no file"),
        ("see ``prefix/gone.py``", "prefix/gone.py`` names no file"),
        ("see ``gone.py``", "gone.py`` names no file"),
        ("see ``zkv.prefix.gone``", "zkv.prefix has no module or name 'gone'"),
        ("see zkv.rank.agent.RankAgent.no_such_method", "RankAgent has no member 'no_such_method'"),
        ("see docs/gone.md §3", "docs/gone.md`` names no doc"),
    ],
)
def test_the_reference_check_catches_what_moved(text, complaint):
    (found,) = [why for _, why in dangling(text, ROOT / "zkv" / "rank" / "core.py")]
    assert complaint in found


def test_the_reference_check_takes_what_exists():
    near = ROOT / "zkv" / "rank" / "core.py"
    for text in (
        "``zkv/rank/core.py``, ``rank/core.py``, ``core.py``, ``memory/layouts.py`` (from zkv/rank/), docs/protocol.md",
        "zkv.rank.agent.RankAgent.start, zkv.Client (a lazy name), zkv.wire.fast.decoder, zkv.rows.bus",
        "vLLM's vllm/v1/core/block_pool.py, https://example.com/x/gone.py, a sentence ending in zkv.wire.",
    ):
        assert list(dangling(text, near)) == [], text


def _timeout(block) -> int:
    """pytest-timeout's bound: a block with long parts gets more once they run."""
    has_long = block.reason("long") is not None or any(m.args[1] == "long" for m in block.named("line"))
    return 1200 if has_long and LONG else 180


RUNS = [pytest.param(b, marks=pytest.mark.timeout(_timeout(b)), id=b.id) for b in SHELL]


@pytest.mark.parametrize("block", RUNS)
def test_block_runs(block):
    if block.reason("skip") is not None:
        pytest.skip(f"not run: {block.reason('skip')}")
    if block.reason("long") is not None and not LONG:
        pytest.skip(f"long ({block.reason('long')}): set ZKV_DOCS_LONG=1 to run it; parse-checked only")
    out = BlockRun(block, LONG).run()
    assert out.strip(), f"{block.id} printed nothing"


# --- the checks themselves can fail -------------------------------------------------------


@pytest.mark.parametrize(
    "args,complaint",
    [
        (["status", "--no-such-option"], "No such option"),
        (["no-such-command"], "has no command"),
        (["submit", "swap-sideways", "--src", "0"], "swap-sideways"),
        (["resume", "--gpu-blocks"], "requires an argument"),
        (["trace", "check"], "missing argument"),
        (["up", "--engine", "sglang", "--demo"], "sglang"),
        (["status", "extra"], "unexpected extra"),
    ],
)
def test_the_parse_check_catches_a_drifted_command(args, complaint):
    with pytest.raises(AssertionError, match=complaint):
        check_zkv(args)
    check_zkv(["status", "--watch", "--interval", "2"])


DOC = """\
<!-- zkv-doc: expect "never printed" -->
```sh
echo hello
```
"""


def test_a_missing_expected_line_fails_the_block():
    (block,) = parse(DOC, "x.md")
    with pytest.raises(AssertionError, match="never printed"):
        BlockRun(block, long=False).run()


def test_a_failing_command_fails_the_block_and_a_served_one_is_stopped():
    text = '<!-- zkv-doc: line "sleep" serve "up" -->\n```sh\nsleep 30 & echo up; wait\necho hi | grep -q bye\n```\n'
    (block,) = parse(text, "x.md")
    with pytest.raises(AssertionError, match="exited 1"):
        BlockRun(block, long=False).run()


@pytest.mark.parametrize(
    "text,complaint",
    [
        ("<!-- zkv-doc: skp typo -->\n```sh\nls\n```\n", "unknown zkv-doc marker"),
        ("<!-- zkv-doc: skip why -->\n\ntext\n", "right above a fenced block"),
        ('<!-- zkv-doc: line "zkv nothing" skip why -->\n```sh\nzkv status\n```\n', "matches no command"),
        ('<!-- zkv-doc: line "ls" wait "x" -->\n```sh\nls\n```\n', "unknown line rule"),
    ],
)
def test_a_marker_that_cannot_be_understood_is_an_error(text, complaint):
    with pytest.raises(DocError, match=complaint):
        parse(text, "x.md")


def test_commands_of_a_block_join_continuations_and_skip_console_output():
    text = "```console\n$ zkv status \\\n    --json\n{...}\n$ zkv pause\npaused\n```\n"
    (block,) = parse(text, "x.md")
    assert [(c.command, c.line) for c in block.commands()] == [("zkv status --json", 2), ("zkv pause", 5)]
