"""Flight Recorder dumps made to hurt replay: refused in one line (exit 2), in bounded time and memory.

Each case of issue 36 (items 1-4) runs the CLI in a child process under
512 MiB of address space and a 10 s limit (``hostile.bounded``): a replay
that hung, grew without bound or raised would be killed, fail with
``MemoryError`` or print a traceback, and the test fails. The properties
below feed the reader what a hostile file can hold (random opcode streams,
memo-shared DAGs, giant length headers, deep nesting in every field) in
process, where thousands of cases cost seconds: the reader either reads a
dump or refuses it with ``FlightRecorderError``, never anything else.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import struct
import time
from pathlib import Path

import pytest
from hostile import (
    HOLE,
    LENGTH_OPCODES,
    bomb,
    bounded,
    dump_doc,
    entry,
    giant_length,
    nested_lists,
    opcodes,
    pickled,
    spliced,
    wide,
    write,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from miles_fsm.apps.cli import main
from miles_fsm.flight_recorder import FlightRecorderError
from miles_fsm.replay.fr_budget import MAX_DEPTH, MAX_NODES, DumpBudgetError, scan
from miles_fsm.replay.fr_native import load_dump

P = "nccl_trace_rank_"
FIELDS = ("profiling_name", "state", "input_sizes", "output_sizes", "input_dtypes", "time_created_ns", "record_id",
          "process_group", "is_p2p")  # fmt: skip
_LONG4 = 41_524_102  # bytes of a 10**8-digit integer


def _refused(folder: Path, *needles: str) -> None:
    run = bounded("--flight-recorder", str(folder))
    assert run.one_line, (run.code, run.err[-2000:])
    assert all(n in run.err for n in needles), run.err


@pytest.mark.parametrize("field", [*FIELDS[:3], "time_created_ns", "ranks"])
def test_a_memo_bomb_in_any_field_is_refused_at_once(tmp_path, field):
    """``[X, X]`` 60 levels deep through the memo (2**60 leaves in ~1 KB) in an entry's field or a group's ranks:
    exit 2 naming the file and the nesting budget, not a hang with memory growing."""
    doc = dump_doc(ranks=bomb()) if field == "ranks" else dump_doc(entry(**{field: bomb()}))
    _refused(write(tmp_path, f"{P}0", pickled(doc)).parent, f"{P}0", f"{MAX_DEPTH} levels")


def test_a_wide_memo_dag_counts_as_all_it_refers_to(tmp_path):
    """200 references to 200 references ... (1.6e9 leaves, 4 levels deep, 2 KB): refused by the node budget."""
    _refused(write(tmp_path, f"{P}0", pickled(dump_doc(entry(state=wide())))).parent, f"{MAX_NODES} nodes")


def test_a_dump_of_a_rank_beyond_any_world_is_refused(tmp_path):
    """``nccl_trace_rank_1000000000``: exit 2 at the rank cap, where replay allocated ~40 GB for its world."""
    _refused(write(tmp_path, f"{P}1000000000", pickled(dump_doc())).parent, "beyond any world")


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (spliced(dump_doc(entry(state=HOLE)), b"]" * 100_000 + b"a" * 99_999), "levels"),
        (spliced(dump_doc(entry(state=HOLE)), b"\x8b" + struct.pack("<i", _LONG4) + b"\x01" * _LONG4), "an integer of"),
        (giant_length("BINBYTES8"), "BINBYTES8 length header of 4611686018427387904"),
        (giant_length("BYTEARRAY8"), "BYTEARRAY8 length header of 4611686018427387904"),
    ],
    ids=["nested-100k", "long4-1e8-digits", "binbytes8-2^62", "bytearray8-2^62"],
)
def test_a_pickle_over_budget_is_one_line(tmp_path, data, says):
    """100 000 nested lists, a 10**8-digit integer, a 2**62-byte length header: exit 2 naming the budget,
    never a RecursionError, a ValueError from printing the integer or a MemoryError."""
    _refused(write(tmp_path, f"{P}0", data).parent, f"{P}0", says)


def test_a_deeply_nested_json_dump_is_one_line(tmp_path):
    """``fr-rank-0.json`` of 100 000 nested arrays: exit 2, not a RecursionError."""
    _refused(write(tmp_path, "fr-rank-0.json", b"[" * 100_000 + b"]" * 100_000).parent, "fr-rank-0.json")


@pytest.mark.parametrize("rest", ["\u00b2", "\u0662", "01", " 1"], ids=["superscript", "arabic-2", "leading-0", "space"])
def test_a_dump_named_with_a_look_alike_rank_is_refused(tmp_path, rest):
    """The traces' name rule for dumps: ``<prefix>01`` or a non-ASCII digit is not read as a rank (nor crashes the
    reader): exit 2 naming the file, beside a good dump of rank 0."""
    write(tmp_path, f"{P}0", pickled(dump_doc()))
    _refused(write(tmp_path, f"{P}{rest}", pickled(dump_doc())).parent, f"{P}{rest}", "ASCII digits")


def test_a_dump_that_is_a_fifo_is_refused_not_skipped(tmp_path):
    """A FIFO named as rank 1's dump: exit 2 (it is not read, and rank 1 is not reported missing), not exit 3."""
    write(tmp_path, f"{P}0", pickled(dump_doc()))
    os.mkfifo(tmp_path / f"{P}1")
    _refused(tmp_path, f"{P}1", "FIFO")


def test_a_json_dump_of_a_rank_beyond_any_world_is_refused(tmp_path):
    """A lifecycle JSON dump whose ``rank`` is 10**9: exit 2, never a world of 10**9 ranks."""
    _refused(write(tmp_path, "fr-rank-0.json", b'{"rank": 1000000000, "fr": {"entries": []}}').parent, "beyond")


# ------------------------------------------------------------------ properties (in process)


def _load(tmp_path: Path, data: bytes) -> None:
    """``load_dump`` reads a dump or refuses it with ``FlightRecorderError``, in well under a second."""
    path = tmp_path / f"{P}0"
    path.write_bytes(data)
    start = time.monotonic()
    try:
        load_dump(path)
    except FlightRecorderError:
        pass
    assert time.monotonic() - start < 2.0


def _cli(folder: Path) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["replay", "--flight-recorder", str(folder)])


_OPS = list(pickletools.opcodes)
_COUNT = {pickletools.TAKEN_FROM_ARGUMENT1: "<B", pickletools.TAKEN_FROM_ARGUMENT4: "<i",
          pickletools.TAKEN_FROM_ARGUMENT4U: "<I", pickletools.TAKEN_FROM_ARGUMENT8U: "<Q"}  # fmt: skip


@st.composite
def _opcode(draw: st.DrawFn) -> bytes:
    op = draw(st.sampled_from(_OPS))
    code, a = op.code.encode("latin-1"), op.arg
    if a is None or a.n == 0:
        return code
    if op.name in ("GLOBAL", "INST"):
        return code + draw(st.sampled_from([b"os\nsystem\n", b"torch.jit._pickle\nbuild_intlist\n", b"x\ny\n"]))
    if a.n == pickletools.UP_TO_NEWLINE:
        return code + draw(st.from_regex(rb"\A[-0-9a-zA-Z'.]{0,12}\n\Z"))
    if a.n > 0:
        return code + draw(st.binary(min_size=a.n, max_size=a.n))
    fmt = _COUNT[a.n]
    data = draw(st.binary(max_size=16))
    bits = struct.calcsize(fmt) * 8
    n = draw(st.one_of(st.just(len(data)), st.integers(0, 2 ** (bits - 1) - 1 if fmt == "<i" else 2**bits - 1)))
    return code + struct.pack(fmt, n) + data


_FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FAST
@given(st.lists(_opcode(), max_size=60))
@example([b"]" * 100, b"a" * 99])  # deep nesting
@example([giant_length("BINBYTES8")[2:-1]])  # a length header past the file
@example([b"\x8a\xff" + b"\x01" * 255])  # LONG1: a 2040-bit integer
@example([b"]", b"r\xff\xff\xff\x7f"])  # LONG_BINPUT 2**31-1: the unpickler would size its memo to it
@example([b"h\x05"])  # a memo read before it was written
@example([b"cos\nsystem\n", b"X\x02\x00\x00\x00ls", b"\x85", b"R"])  # code to run
def test_random_opcode_streams_are_read_or_refused(tmp_path, ops):
    """Any opcode stream (random opcodes, random arguments, lengths that lie): a dump or one refusal."""
    _load(tmp_path, opcodes(*ops))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([*FIELDS, "ranks"]), st.integers(2, 300), st.integers(1, 64))
@example("state", 2, 60)  # the issue's bomb: [X, X] 60 deep
@example("input_sizes", 200, 4)  # wide and shallow: 1.6e9 leaves
@example("ranks", 2, 60)
def test_memo_shared_dags_count_as_all_they_refer_to(tmp_path, field, fan, levels):
    """A value shared through the memo in any field: read only when its expanded size is in the budget."""
    x: list = [0]
    for _ in range(levels):
        x = [x] * fan
    doc = dump_doc(ranks=x) if field == "ranks" else dump_doc(entry(**{field: x}))
    path = tmp_path / f"{P}0"
    path.write_bytes(pickled(doc))
    nodes = sum(fan**k for k in range(levels + 1))  # the value expanded: every reference counts
    over = nodes > MAX_NODES or levels > MAX_DEPTH
    under = nodes + 1000 < MAX_NODES and levels + 5 < MAX_DEPTH  # room for the rest of the dump
    try:
        load_dump(path)
    except DumpBudgetError:
        assert not under
        return
    except FlightRecorderError:  # a field of the wrong type, refused within the budget
        pass
    assert not over


@_FAST
@given(st.sampled_from(sorted(LENGTH_OPCODES)), st.integers(17, 2**64 - 1))
@example("BINBYTES8", 2**62)
@example("BYTEARRAY8", 2**62)
@example("BINUNICODE8", 2**64 - 1)
def test_giant_length_headers_are_refused_before_allocation(tmp_path, opcode, n):
    """A length header larger than the file: refused before the unpickler allocates it."""
    path = tmp_path / f"{P}0"
    path.write_bytes(giant_length(opcode, n))
    with pytest.raises(FlightRecorderError):
        load_dump(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([*FIELDS, "ranks", "pg_config", "entries", "version"]), st.integers(1, 100_000))
@example("state", 100_000)
@example("ranks", MAX_DEPTH + 1)
@example("input_sizes", 3)
def test_deep_nesting_in_any_field_is_read_or_refused_in_one_line(tmp_path, field, depth):
    """Lists nested ``depth`` deep in any field of a dump: the CLI exits 2 (or reads it), never a traceback."""
    body = nested_lists(depth)[2:-1]
    if field in ("pg_config", "entries", "version"):
        doc = {**dump_doc(), field: HOLE}
    else:
        doc = dump_doc(ranks=HOLE) if field == "ranks" else dump_doc(entry(**{field: HOLE}))
    write(tmp_path, f"{P}0", spliced(doc, body))
    assert _cli(tmp_path) in (0, 2, 3)


_LEAF = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=300),
                  st.floats(allow_nan=False), st.booleans(), st.none())  # fmt: skip
_TREE = st.recursive(_LEAF, lambda c: st.one_of(st.lists(c, max_size=5), st.tuples(c, c),
                                                st.dictionaries(st.text(max_size=5), c, max_size=4)),
                     max_leaves=40)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(_TREE, st.integers(0, 5), st.booleans())
@example({"entries": [{"state": "scheduled"}]}, 2, True)
def test_an_honest_pickle_within_the_budget_is_never_refused(value, protocol, shared):
    """Whatever Python's pickler writes (every protocol, values shared through the memo) passes the scan when it
    is within the budget: the budget refuses hostile files, not dumps."""
    scan(pickle.dumps(value if not shared else [value, value, {"again": value}], protocol=protocol), "a dump")
