"""Streaming reader of per-rank JSONL traces, folded into one compact summary per rank.

A rank file is read in blocks and never held whole, and folded by
``miles_fsm.replay.fold``; a closed trace's fold is read from its index
instead (``miles_fsm.replay.index``), while the index still matches it.
Ranks fold independently, so ``read_ranks`` can spread them over processes. A file whose lines are not its records in
``seq`` order (shuffled, duplicated, another run's records) is folded again
from its records sorted by ``seq`` (``miles_fsm.replay.order``): only a
damaged file pays for that.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from miles_fsm.replay.files import blocks, default_workers
from miles_fsm.replay.fold import fold
from miles_fsm.replay.index import check_index
from miles_fsm.replay.model import Damage, EpochRange, RankTrace, TraceDirError
from miles_fsm.replay.order import in_seq_order

__all__ = ["read_rank", "read_ranks"]

def read_ranks(
    files: dict[int, Path],
    *,
    epochs: EpochRange | None = None,
    workers: int | None = None,
    run: str | None = None,
) -> list[RankTrace]:
    """Fold every rank file (only the records of ``run``, if given); with ``workers`` > 1, in processes."""
    items = list(files.items())
    if workers is None:
        workers = default_workers(files.values())
    if workers <= 1 or len(items) < 2:
        return [read_rank(p, r, epochs=epochs, run=run) for r, p in items]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # forkserver: a fork of a threaded parent may deadlock, and spawn re-runs __main__.
    ctx = mp.get_context("forkserver")
    chunk = max(1, len(items) // (workers * 8))
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(_read_item, items, [epochs] * len(items), [run] * len(items), chunksize=chunk))


def _read_item(item: tuple[int, Path], epochs: EpochRange | None, run: str | None) -> RankTrace:
    return read_rank(item[1], item[0], epochs=epochs, run=run)


def read_rank(
    path: str | os.PathLike[str],
    rank: int,
    *,
    epochs: EpochRange | None = None,
    run: str | None = None,
    use_index: bool = True,
) -> RankTrace:
    """Fold one rank's trace file (only the records of ``run``, if given). Unreadable files raise ``TraceDirError``.

    The fold of a whole trace comes from its index (``miles_fsm.replay.index``)
    while the index still describes the file, unless ``use_index`` is False.
    An index that proves the trace changed after its writer closed it is
    damage, reported with the fold of the lines.
    """
    path = Path(path)
    changed, proven = None, False
    if use_index:
        index = check_index(path, rank)
        if index.fold is not None:
            proven = True  # the file is the one its writer closed, whether its fold is read or filtered
            if epochs is None and run is None:
                index.fold.proven = True
                return index.fold
        changed = index.changed
    t = RankTrace(rank=rank, path=str(path))
    try:
        if not fold(t, blocks(path), path, epochs, run):
            t = _fold_in_seq_order(rank, path, epochs, run)
    except OSError as exc:
        raise TraceDirError(path, f"cannot read it ({exc.strerror or exc})") from exc
    if changed is not None:
        t.damaged.insert(0, Damage(path=str(path), line=0, records=0, reason=changed))
    t.proven = proven
    return t


def _fold_in_seq_order(rank: int, path: Path, epochs: EpochRange | None, run: str | None) -> RankTrace:
    """Fold a file whose lines are not its records in ``seq`` order, from its records sorted by ``seq``."""
    o = in_seq_order(path, run) if run is not None else in_seq_order(path)
    t = RankTrace(rank=rank, path=str(path))
    if not fold(t, [(o.lines, True)], path, epochs, o.run, run_known=True):
        raise RuntimeError(f"miles-fsm bug: the records of {path}, sorted by seq, do not add up; please report it")
    line_of = [0, *o.line_of]
    t.illegal = [replace(i, line=line_of[i.line]) for i in t.illegal]
    t.notes = [replace(n, line=line_of[n.line]) for n in t.notes]
    t.damaged = [replace(d, line=line_of[d.line]) for d in t.damaged]
    t.bad = sorted([*o.bad, *(replace(b, line=line_of[b.line]) for b in t.bad)], key=lambda b: b.line)
    t.last_line = line_of[t.last_line]
    t.lines, t.truncated, t.duplicates = o.total_lines, o.truncated, o.duplicates
    t.runs, t.run, t.out_of_order = o.runs, o.run, o.out_of_order
    return t
