"""Outputs never overwrite inputs (issue 36, item 8): ``--perfetto`` onto a FIFO, a device, or a link to a file
replay reads is refused in one line (exit 2); a write that fails leaves nothing that looks complete.

The CLI runs in a child process under a time limit (``hostile.bounded``), so an output that blocks (a FIFO
nobody reads) fails the test instead of hanging it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hostile import bounded, dump_doc, pickled, write
from trace_writer import healthy


def _traces(root: Path) -> Path:
    root.mkdir(parents=True)
    healthy(root, world=2)
    return root


def _refused(*argv: str, says: str) -> None:
    run = bounded(*argv)
    assert run.one_line, (run.code, run.err[-2000:])
    assert "--perfetto" in run.err and says in run.err, run.err


def test_a_fifo_as_the_timeline_is_refused_not_opened(tmp_path):
    """``--perfetto`` onto a FIFO nobody reads: replay blocked forever opening it; now exit 2 at once."""
    root = _traces(tmp_path / "t")
    os.mkfifo(tmp_path / "timeline.json")
    _refused(str(root), "--perfetto", str(tmp_path / "timeline.json"), says="FIFO")


def test_a_device_as_the_timeline_is_refused(tmp_path):
    """``--perfetto /dev/full``: an OSError traceback (ENOSPC) before; now exit 2, the device named."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    _refused(str(_traces(tmp_path / "t")), "--perfetto", "/dev/full", says="a device")


@pytest.mark.parametrize("link", ["hard", "symbolic"])
@pytest.mark.parametrize("target", ["rank-0.jsonl", "rank-1.jsonl.index"])
def test_a_link_to_a_file_replay_reads_is_refused_and_left_as_it_was(tmp_path, link, target):
    """A hard or symbolic link, under another name in another folder, to a rank trace or its index: the
    trace was overwritten and the run then read OK; now exit 2 (same device and inode), the file untouched."""
    root = _traces(tmp_path / "t")
    if target.endswith(".index"):
        from miles_fsm.replay.index import write_index

        write_index(root / "rank-1.jsonl", 1)
    out = tmp_path / "elsewhere" / "timeline.json"
    out.parent.mkdir()
    (os.link if link == "hard" else os.symlink)(root / target, out)
    before = (root / target).read_bytes()
    _refused(str(root), "--perfetto", str(out), says="the same file as")
    assert (root / target).read_bytes() == before


def test_a_link_to_a_dump_read_alone_is_refused(tmp_path):
    """Dumps alone (no traces): a hard link to a dump as the timeline is refused, the dump untouched."""
    dump = write(tmp_path / "fr", "nccl_trace_rank_0", pickled(dump_doc()))
    os.link(dump, tmp_path / "timeline.json")
    _refused("--flight-recorder", str(dump.parent), "--perfetto", str(tmp_path / "timeline.json"), says="same file")
    assert dump.read_bytes() == pickled(dump_doc())


def test_a_write_that_fails_is_one_line_and_leaves_the_old_file(tmp_path):
    """A write error mid-timeline (EFBIG past RLIMIT_FSIZE, as ENOSPC on a full disk): exit 2 in one line; the
    timeline already there is left whole, and no temporary or half-written file is left beside it."""
    root = _traces(tmp_path / "t")
    out = tmp_path / "out" / "timeline.json"
    out.parent.mkdir()
    out.write_bytes(b'{"traceEvents": []}\n')
    run = bounded(str(root), "--perfetto", str(out), file_size=4096)
    assert run.one_line, (run.code, run.err[-2000:])
    assert "cannot be written" in run.err
    assert out.read_bytes() == b'{"traceEvents": []}\n'
    assert sorted(p.name for p in out.parent.iterdir()) == ["timeline.json"]


def test_a_timeline_is_written_whole_through_a_symlink(tmp_path):
    """A symbolic link to a file replay does not read: the timeline lands where it points, the link stays."""
    root = _traces(tmp_path / "t")
    real = tmp_path / "real.json"
    real.write_bytes(b"old")
    (tmp_path / "link.json").symlink_to(real)
    run = bounded(str(root), "--perfetto", str(tmp_path / "link.json"))
    assert run.code == 0, run.err
    assert (tmp_path / "link.json").is_symlink() and real.read_bytes().startswith(b'{"displayTimeUnit"')
