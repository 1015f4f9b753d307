"""Figures that hold others name a leak once, by the figure that grew (issue 37, the H100 run of 2026-12-07).

The device in use (the whole device) holds torch's reserved bytes, which hold
its allocated bytes; the RSS holds torch's pinned bytes. On the H100, a CUDA
tensor of 128 MiB kept per cycle from cycle 3 grew ``torch:allocated`` by a
line and ``torch:reserved`` and ``in_use`` by a staircase (the caching
allocator reserved ~394 MiB segments): the live check named ``torch:allocated``
at 128 MiB/cycle and ``in_use`` at 413 MB/cycle, where the truth is 134 MB.
The series below are that run's figures, as replay's JSON recorded them.
``DriftTracker`` is what the live check and replay both feed.
"""

from __future__ import annotations

import pytest

from miles_fsm.config import DriftConfig
from miles_fsm.memory_drift import DriftFinding, DriftTracker, figures_of
from miles_fsm.replay.leaks import MemorySeries, find_leaks, leak_lines
from miles_fsm.states.errors import MemoryDriftError

MiB = 1 << 20
GiB = 1 << 30

# The device leak run at TRAINING, cycles 0..12 (bytes).
IN_USE = [32267632640, 41046310912, 41046310912, 41046310912, 41459449856, 41459449856, 41872588800,
          41872588800, 41872588800, 42285727744, 42285727744, 42285727744, 42698866688]  # fmt: skip
RESERVED = [29563551744, 38298189824, 38298189824, 38298189824, 38711328768, 38711328768, 39124467712,
            39124467712, 39124467712, 39537606656, 39537606656, 39537606656, 39950745600]  # fmt: skip
ALLOCATED = [29192217088, 29192217088, 29192217088, 29326434816, 29460652544, 29594870272, 29729088000,
             29863305728, 29997523456, 30131741184, 30265958912, 30400176640, 30534394368]  # fmt: skip
#: At OFFLOADED the device in use is the same staircase less the memory torch_memory_saver paused (replay's
#: baseline of it there: 15169552384 at cycle 3); torch still counts the paused regions as reserved.
PAUSED = IN_USE[3] - 15169552384
# The pinned leak run at TRAINING, cycles 0..12: torch's pinned bytes and the RSS.
PINNED = [2097164, 2097164, 2097164, 270532620, 538968076, 807403532, 1075838988, 1344274444, 1612709900,
          1881145356, 2149580812, 2418016268, 2686451724]  # fmt: skip
RSS = [79674654720, 102318202880, 102318215168, 102586650624, 102855086080, 103123521536, 103391956992,
       103660392448, 103928827904, 104197263360, 104465698816, 104734150656, 105002586112]  # fmt: skip


def _device(c: int, state: str) -> dict[str, int]:
    off = PAUSED if state == "OFFLOADED" else 0
    return {"in_use": IN_USE[c] - off, "torch:reserved": RESERVED[c], "torch:allocated": ALLOCATED[c]}


def _device_run() -> list[tuple[int, str, dict[str, int], dict[str, int], int | None]]:
    """The snapshots in a cycle's order: OFFLOADED (where the live check named ``in_use``), then TRAINING."""
    return [(c, state, _device(c, state), {}, None) for c in range(13) for state in ("OFFLOADED", "TRAINING")]


def _pinned_run() -> list[tuple[int, str, dict[str, int], dict[str, int], int | None]]:
    return [(c, "TRAINING", {}, {"torch:pinned": PINNED[c]}, RSS[c]) for c in range(13)]


def _live(snapshots) -> tuple[DriftTracker, list[tuple[int, DriftFinding]]]:
    tracker = DriftTracker(DriftConfig())
    named = [(c, f) for c, state, dev, host, rss in snapshots for f in tracker.add(c, state, figures_of(dev, host, rss))]
    return tracker, named


def test_the_h100_device_leak_is_named_once_by_torch_allocated_at_its_slope():
    """Named once, by torch's allocated bytes, at cycle 6, 128 MiB/cycle live and refitted; the device in use and
    torch's reserved bytes are not named (they grew by the staircase only as the allocated bytes did)."""
    tracker, named = _live(_device_run())
    assert [(c, f.kind, f.tag) for c, f in named] == [(6, "device", "torch:allocated")]
    live = named[0][1]
    assert live.slope == pytest.approx(128 * MiB, rel=0.15) and live.inside is None
    assert [(f.tag, f.slope) for f in tracker.findings()] == [("torch:allocated", pytest.approx(128 * MiB, rel=0.15))]


def test_the_finding_says_the_outer_figures_grew_with_it():
    """The user is told that torch's reserved bytes and the device in use grew with the leak, by how much, and why
    they are not named: live (the warning's and error's text) and in replay (the Leaks section)."""
    _, named = _live(_device_run())
    finding = named[0][1]
    assert [tag for tag, _ in finding.grew_with] == ["torch:reserved", "in_use"]
    assert dict(finding.grew_with)["in_use"] == IN_USE[6] - IN_USE[3]  # over the cycles the slope is fitted on
    err = MemoryDriftError(rank=0, tag=finding.tag, state=finding.state, first_cycle=finding.first_cycle,
                           bytes_per_cycle=finding.bytes_per_cycle, slope=finding.slope, kind=finding.kind,
                           grown=finding.grown, inside=finding.inside, grew_with=finding.grew_with)  # fmt: skip
    assert "'torch:reserved' (+788.0 MiB) and 'in_use' (+788.0 MiB) grew with it" in str(err)
    assert "CUDA tensors kept" in str(err)
    leaks = find_leaks([MemorySeries(0, snapshots=[(0, *s) for s in _device_run()])])
    assert [(k["kind"], k["tag"]) for k in leaks] == [("device", "torch:allocated")]
    assert leaks[0]["slope"] == pytest.approx(128 * MiB, rel=0.15)
    assert "'torch:reserved' +1576.0 MiB and 'in_use' +1576.0 MiB grew with it" in leak_lines(leaks)[1][1]


def test_the_h100_pinned_leak_is_named_once_by_torch_pinned():
    """256 MiB of pinned host memory kept per cycle from cycle 3 raised torch's pinned bytes and the RSS alike on
    the H100, and both were named: now torch's pinned bytes alone, at cycle 6, 256 MiB/cycle, the RSS with it."""
    tracker, named = _live(_pinned_run())
    assert [(c, f.kind, f.tag) for c, f in named] == [(6, "host", "torch:pinned")]
    assert named[0][1].slope == pytest.approx(256 * MiB, rel=0.15)
    assert [tag for tag, _ in named[0][1].grew_with] == ["process"]
    assert [f.tag for f in tracker.findings()] == ["torch:pinned"]


def _leak_outside(tag: str, *, from_cycle: int = 3) -> list[tuple[int, str, dict, dict, int | None]]:
    """The H100's healthy figures, flat, with 128 MiB/cycle more from ``from_cycle`` in ``tag`` and what holds it."""
    grow = ["torch:allocated", "torch:reserved", "in_use"]
    out = []
    for c in range(13):
        extra = 128 * MiB * max(0, c - from_cycle + 1)
        dev = {t: v + (extra if t in grow[grow.index(tag):] else 0) for t, v in _device(1, "TRAINING").items()}
        out.append((c, "TRAINING", dev, {}, None))
    return out


@pytest.mark.parametrize(
    ("tag", "inside", "grew_with"),
    [
        ("in_use", "torch:reserved", []),  # another library's cudaMalloc, NCCL: outside torch's allocator
        ("torch:reserved", "torch:allocated", ["in_use"]),  # the cache grows, the tensors do not: fragmentation
    ],
)
def test_growth_outside_the_inner_figure_is_named_by_the_outer_one(tag, inside, grew_with):
    """Device memory that grows outside torch's allocator is named by the device in use; torch's cache growing with
    no allocation growth by torch's reserved bytes: once, at cycle 6, its slope the truth's."""
    tracker, named = _live(_leak_outside(tag))
    assert [(c, f.tag, f.inside) for c, f in named] == [(6, tag, inside)]
    assert named[0][1].slope == pytest.approx(128 * MiB) and [t for t, _ in named[0][1].grew_with] == grew_with
    assert tracker.findings()[0].slope == pytest.approx(128 * MiB)


def test_an_inner_figure_that_comes_and_goes_is_no_growth():
    """CUDA initialized at cycle 6 (torch's pinned bytes appear beside an 8 GiB RSS), and a damaged trace that
    drops them again at cycle 14: the outer figure is judged afresh each time, never on the jump. No finding."""
    snaps = []
    for c in range(1, 25):
        host = {"torch:pinned": 2 * MiB} if 6 <= c < 14 else {}
        snaps.append((c, "TRAINING", {}, host, 8 * GiB + (4 * MiB if c % 2 else 0)))
    tracker, named = _live(snaps)
    assert named == [] and tracker.findings() == []
