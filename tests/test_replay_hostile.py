"""Traces made to hurt replay (issue 36, items 5-7 and 9): a problem verdict or one line, in bounded memory.

Each case runs the CLI in a child process under 512 MiB of address space
and a time limit (``hostile.bounded``): a reader that holds a long line
whole fails there with ``MemoryError``, one that blocks is killed, one that
recurses prints a traceback. The trace cases end in a verdict (exit 3) with
the damage listed; the unreadable cases in one line (exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
from hostile import bounded
from trace_writer import healthy


def _traces(root: Path) -> Path:
    healthy(root, world=2)
    return root


def test_a_line_of_hundreds_of_mb_is_not_held_in_memory(tmp_path):
    """A 300 MB line naming ``memory_snapshot``, with no newline (the leak reader held it whole: 1.1 GB for
    500 MB): replay reads it in 16 MiB blocks, reports it, and stays far below the line's size."""
    root = _traces(tmp_path)
    with open(root / "rank-0.jsonl", "ab") as f:
        f.write(b'{"event":"memory_snapshot","device":{"x":' + b"1" * (300 << 20))
    run = bounded(str(root), "--json", seconds=30)
    assert run.code == 3, run.err[-2000:]
    problems = orjson.loads(run.out)["trace_problems"]
    assert problems["truncated"] or problems["bad_lines"], problems
    assert run.max_rss_mib < 200, run.max_rss_mib


def test_a_line_over_16_mib_is_reported_not_read(tmp_path):
    """A complete 20 MiB line naming ``memory_snapshot`` in the middle of a trace: a bad line, "not read"."""
    root = _traces(tmp_path)
    path = root / "rank-0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    big = b'{"event":"memory_snapshot","device":{"x":' + b"1" * (20 << 20) + b"}}\n"
    path.write_bytes(b"".join([*lines[:3], big, *lines[3:]]))
    run = bounded(str(root), "--json")
    assert run.code == 3, run.err[-2000:]
    bad = orjson.loads(run.out)["trace_problems"]["bad_lines"]
    assert any("over 16 MiB" in b["reason"] for b in bad), bad


def test_a_deeply_nested_line_naming_memory_snapshot_is_a_bad_line(tmp_path):
    """100 000 nested arrays around ``"memory_snapshot"`` (200 KB): the leak reader's ``json`` raised
    RecursionError (exit 1); now the line is listed as not JSON and the verdict says the trace is damaged."""
    root = _traces(tmp_path)
    with open(root / "rank-0.jsonl", "ab") as f:
        f.write(b"[" * 100_000 + b'"memory_snapshot"' + b"]" * 100_000 + b"\n")
    run = bounded(str(root), "--json")
    assert run.code == 3, run.err[-2000:]
    assert orjson.loads(run.out)["trace_problems"]["bad_lines"]


def test_an_index_that_is_a_fifo_is_refused_not_opened(tmp_path):
    """``rank-0.jsonl.index`` made a FIFO: replay blocked forever opening it; now exit 2 naming it."""
    root = _traces(tmp_path)
    (root / "rank-0.jsonl.index").unlink(missing_ok=True)
    os.mkfifo(root / "rank-0.jsonl.index")
    run = bounded(str(root))
    assert run.one_line, (run.code, run.err[-2000:])
    assert "rank-0.jsonl.index" in run.err and "FIFO" in run.err


def test_an_index_larger_than_any_index_of_its_trace_is_not_read(tmp_path):
    """An index of 64 MiB beside a trace of a few KB: not read (the lines are), so it costs nothing."""
    root = _traces(tmp_path)
    with open(root / "rank-0.jsonl.index", "wb") as f:
        f.truncate(64 << 20)
    run = bounded(str(root), memory=256 << 20)
    assert run.code == 0, run.err[-2000:]
    assert run.max_rss_mib < 100


def test_json_of_a_folder_whose_name_is_not_utf8(tmp_path):
    """``--json`` on a folder named in another encoding (byte 0xff): the object, its paths spelled ``\\xff``,
    not a TypeError from the encoder."""
    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/run-\xff"))
    root.mkdir()
    _traces(root)
    run = bounded(str(root), "--json")
    assert run.code == 0, run.err[-2000:]
    doc = orjson.loads(run.out)
    assert doc["verdict"] == "ok" and "run-\\xff" in doc["ranks"][0]["file"]
