"""The budget of a Flight Recorder dump: what replay reads of a file before it believes it is one.

A dump is untrusted, and a few bytes of pickle can describe far more than
they hold: a list of the same list twice, 60 levels deep through the memo,
is 2^60 leaves in 1.5 KB; a length header of 2^62 makes the unpickler
allocate before it reads; a memo index of 2^31 makes it grow its memo
table to match. So the opcodes are read first (``scan``), with the sizes
they claim checked against the file and each container's size counted as
its expanded tree (a memo reference counts as all it refers to), and only a
pickle within every budget is unpickled. A dump of any format is then
walked once (``bounded``) with the same budgets, which also refuses a cycle
and a JSON dump nested too deep.

The budgets are far above what torch writes: a 2000-entry dump with stack
traces is a few MB and a few hundred thousand nodes, at most 6 levels deep.
"""

from __future__ import annotations

import pickletools
import struct
from typing import Any

from miles_fsm import flight_recorder as fr
from miles_fsm.replay.checks import MAX_DEPTH

__all__ = ["MAX_DUMP_BYTES", "MAX_INT_BYTES", "MAX_NODES", "DumpBudgetError", "bounded", "scan"]

#: The largest dump file read (pickle or JSON).
MAX_DUMP_BYTES = 64 << 20
#: Nodes (containers and values) of a dump, a value reached twice through the memo counted twice.
MAX_NODES = 1 << 22
#: The longest integer a pickle may spell, in bytes (a dump's largest is a 64-bit time).
MAX_INT_BYTES = 16
_MAX_INT_TEXT = 40  # digits of a text-spelled integer (INT, LONG): a 64-bit one has 20


class DumpBudgetError(fr.FlightRecorderError):
    """A file named as a Flight Recorder dump is larger, deeper or longer than any dump: refused unread."""

    def __init__(self, *, path: str, limit: str, found: str) -> None:
        self.limit = limit
        self.found = found
        super().__init__(path=path, reason=f"{found}, over its budget of {limit}; no Flight Recorder dump is, "
                         "so it was refused before it was built (is it really a dump?)")  # fmt: skip


_OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_LEAVES = frozenset(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING",
                     "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "NONE", "NEWTRUE",
                     "NEWFALSE", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "FLOAT", "BINFLOAT",
                     "GLOBAL", "EXT1", "EXT2", "EXT4", "PERSID", "NEXT_BUFFER"))  # fmt: skip
_EMPTY = frozenset(("EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_DICT", "EMPTY_SET"))
_FROM_MARK = frozenset(("LIST", "TUPLE", "DICT", "FROZENSET", "INST", "OBJ"))
_INTO_TOP = {"APPEND": 1, "SETITEM": 2, "BUILD": 1}
_INTO_TOP_FROM_MARK = frozenset(("APPENDS", "SETITEMS", "ADDITEMS"))
_POP_PUSH = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "STACK_GLOBAL": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "BINPERSID": 1,
             "REDUCE": 2}  # fmt: skip
_PUT = frozenset(("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"))
_GET = frozenset(("GET", "BINGET", "LONG_BINGET"))
_COUNTED = {pickletools.TAKEN_FROM_ARGUMENT1: ("<B", 1), pickletools.TAKEN_FROM_ARGUMENT4: ("<i", 4),
            pickletools.TAKEN_FROM_ARGUMENT4U: ("<I", 4), pickletools.TAKEN_FROM_ARGUMENT8U: ("<Q", 8)}  # fmt: skip
_LEAF = (1, 0)  # a value: one node, no depth
_BY_NAME = {op.name: op.code.encode("latin-1")[0] for op in pickletools.opcodes}
#: Values with an argument of fixed size (BININT1, BININT, BININT2, BINFLOAT, NONE, NEWTRUE, NEWFALSE).
_FIXED_LEAVES = {_BY_NAME[name]: n for name, n in (("BININT1", 1), ("BININT", 4), ("BININT2", 2), ("BINFLOAT", 8),
                                                    ("NONE", 0), ("NEWTRUE", 0), ("NEWFALSE", 0))}  # fmt: skip
#: Values whose unsigned length header of that many bytes says how many bytes follow.
_COUNTED_LEAVES = {_BY_NAME[name]: width for name, width in (("SHORT_BINUNICODE", 1), ("BINUNICODE", 4),
                                                             ("SHORT_BINBYTES", 1), ("BINBYTES", 4))}  # fmt: skip
_BINGET, _BINPUT, _MEMOIZE, _MARK = _BY_NAME["BINGET"], _BY_NAME["BINPUT"], _BY_NAME["MEMOIZE"], _BY_NAME["MARK"]
_EMPTY_CODES = frozenset(_BY_NAME[name] for name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "EMPTY_SET"))
_MANY_CODES = frozenset(_BY_NAME[name] for name in ("APPENDS", "SETITEMS", "ADDITEMS"))


class _Scan:
    """The unpickler's stack and memo, each item its (expanded size, depth), never the objects themselves."""

    def __init__(self, data: bytes, path: str) -> None:
        self.data, self.path, self.pos = data, path, 0
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: list[Any] = []

    def run(self) -> None:
        # The opcodes a dump is mostly made of (values, memo reads and writes, marks, containers) are read
        # inline, which halves the scan (0.38 s for a 2000-entry dump with stacks, 3.4 MB). Every other
        # opcode goes through ``one``.
        data, stack, memo, marks = self.data, self.stack, self.memo, self.marks
        end, pos = len(data), self.pos
        while pos < end:
            code = data[pos]
            n = _FIXED_LEAVES.get(code)
            if n is not None:
                pos += 1 + n
                if pos > end:
                    raise self.malformed("it ends early (truncated), inside an opcode")
                stack.append(_LEAF)
                continue
            width = _COUNTED_LEAVES.get(code)
            if width is not None and pos + 1 + width <= end:
                size = int.from_bytes(data[pos + 1 : pos + 1 + width], "little")
                if size > MAX_DUMP_BYTES or pos + 1 + width + size > end:
                    self.pos = pos
                    self.one()  # says which: over the budget, or cut off
                pos += 1 + width + size
                stack.append(_LEAF)
                continue
            if code == _BINGET and pos + 1 < end:
                index = data[pos + 1]
                if index >= len(memo) or memo[index] is None:
                    raise self.malformed(f"memo {index} read before it was written")
                stack.append(memo[index])
                pos += 2
                continue
            if code == _MARK:
                marks.append(len(stack))
                pos += 1
                continue
            if code in _EMPTY_CODES:
                stack.append([1, 1])
                pos += 1
                continue
            if (code == _BINPUT and pos + 1 < end) or code == _MEMOIZE:
                self.put(data[pos + 1] if code == _BINPUT else len(memo))
                pos += 2 if code == _BINPUT else 1
                continue
            if code in _MANY_CODES:
                self.grow(self.top_below_mark(), self.pop_mark())
                pos += 1
                continue
            self.pos = pos
            if self.one():
                return
            pos = self.pos
        raise self.malformed("it ends early (truncated), before its STOP opcode")

    def one(self) -> bool:
        """Read the opcode at ``pos`` and act on the stack; True at ``STOP``."""
        op = _OPS.get(self.data[self.pos])
        if op is None:
            raise self.malformed(f"no opcode {self.data[self.pos]:#x} at byte {self.pos}")
        self.pos += 1
        arg = self.arg(op)
        if op.name == "STOP":
            self.top()  # the unpickler returns the top of its stack
            return True
        self.step(op.name, arg)
        return False

    def arg(self, op: Any) -> int | None:
        """Skip the opcode's argument; the integer it is, for memo indexes and counts."""
        a = op.arg
        if a is None or a.n == 0:
            return None
        if op.name in ("GLOBAL", "INST"):
            self.line(256)
            self.line(256)
            return None
        if a.n == pickletools.UP_TO_NEWLINE:
            text = self.line(_MAX_INT_TEXT if op.name in ("INT", "LONG", "GET", "PUT") else len(self.data))
            if op.name in ("GET", "PUT"):
                return int(text) if text.isdigit() else -1
            return None
        if a.n > 0:
            raw = self.take(a.n)
            if op.name in ("BINGET", "BINPUT", "LONG_BINGET", "LONG_BINPUT"):
                return int.from_bytes(raw, "little")
            return None
        fmt, width = _COUNTED[a.n]
        n: int = struct.unpack(fmt, self.take(width))[0]
        if op.name in ("LONG1", "LONG4") and n > MAX_INT_BYTES:
            raise DumpBudgetError(path=self.path, limit=f"{MAX_INT_BYTES} bytes an integer",
                                  found=f"an integer of {n} bytes (about {n * 12 // 5} digits)")  # fmt: skip
        if n < 0 or n > MAX_DUMP_BYTES:
            raise DumpBudgetError(path=self.path, limit=f"{MAX_DUMP_BYTES} bytes a dump",
                                  found=f"a {op.name} length header of {n} bytes at byte {self.pos - width - 1}")  # fmt: skip
        if n > len(self.data) - self.pos:
            raise self.malformed(f"it ends early (truncated): {op.name} at byte {self.pos - width - 1} says {n} bytes "
                             f"follow, {len(self.data) - self.pos} do")  # fmt: skip
        self.pos += n
        return n

    def malformed(self, why: str) -> fr.FlightRecorderError:
        """The opcodes make no pickle: said as the unpickler's own errors are."""
        return fr.FlightRecorderError(path=self.path, reason=why if why.startswith("it ends") else f"not a pickle: {why}")

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.malformed("it ends early (truncated), inside an opcode")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return raw

    def line(self, limit: int) -> bytes:
        end = self.data.find(b"\n", self.pos, self.pos + limit + 1)
        if end < 0:
            if self.data.find(b"\n", self.pos) < 0:
                raise self.malformed("it ends early (truncated), inside an opcode")
            raise DumpBudgetError(path=self.path, limit=f"{limit} characters a text argument",
                                  found=f"a longer one at byte {self.pos}")  # fmt: skip
        text = self.data[self.pos : end]
        self.pos = end + 1
        return text

    def step(self, name: str, arg: int | None) -> None:
        if name in _LEAVES:
            self.stack.append(_LEAF)
        elif name in _EMPTY:
            self.stack.append([1, 1])
        elif name == "MARK":
            self.marks.append(len(self.stack))
        elif name in _FROM_MARK:
            self.stack.append(self.grow([1, 1], self.pop_mark()))
        elif name in _INTO_TOP:
            items = self.pop(_INTO_TOP[name])
            self.grow(self.top(), items)
        elif name in _INTO_TOP_FROM_MARK:
            self.grow(self.top_below_mark(), self.pop_mark())
        elif name in _POP_PUSH:
            self.stack.append(self.grow([1, 1], self.pop(_POP_PUSH[name])))
        elif name in _PUT:
            self.put(len(self.memo) if arg is None else arg)
        elif name in _GET:
            if arg is None or not 0 <= arg < len(self.memo) or self.memo[arg] is None:
                raise self.malformed(f"memo {arg} read before it was written")
            self.stack.append(self.memo[arg])
        elif name == "POP":
            if self.marks and self.marks[-1] == len(self.stack):
                self.marks.pop()
            else:
                self.pop(1)
        elif name == "DUP":
            self.stack.append(self.top())
        elif name == "POP_MARK":
            self.pop_mark()
        # PROTO, FRAME, READONLY_BUFFER: nothing on the stack

    def put(self, index: int) -> None:
        # The unpickler grows its memo table to the index it is given: only the next one, or one in use.
        if not 0 <= index <= len(self.memo):
            raise DumpBudgetError(path=self.path, limit=f"memo indexes in order (the next is {len(self.memo)})",
                                  found=f"memo index {index}")  # fmt: skip
        if index == len(self.memo):
            self.memo.append(None)
        self.memo[index] = self.top()

    def grow(self, node: Any, items: list[Any]) -> Any:
        if node.__class__ is not list:
            raise self.malformed("an item added to a value that holds none")
        for size, depth in items:
            node[0] += size
            node[1] = max(node[1], depth + 1)
        if node[0] > MAX_NODES:
            raise DumpBudgetError(path=self.path, limit=f"{MAX_NODES} nodes",
                                  found=f"a value of more than {MAX_NODES} nodes (a memo reference counts as all "
                                  "it refers to)")  # fmt: skip
        if node[1] > MAX_DEPTH:
            raise DumpBudgetError(path=self.path, limit=f"{MAX_DEPTH} levels of nesting",
                                  found=f"values nested {node[1]} levels deep")  # fmt: skip
        return node

    def top(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.malformed("an opcode with nothing on the stack")
        return self.stack[-1]

    def top_below_mark(self) -> Any:
        """What APPENDS and its kind add to: the item just below the last MARK."""
        if not self.marks:
            raise self.malformed("an opcode wants a MARK that is not there")
        at = self.marks[-1]
        if at <= (self.marks[-2] if len(self.marks) > 1 else 0):
            raise self.malformed("an opcode with nothing on the stack")
        return self.stack[at - 1]

    def pop(self, n: int) -> list[Any]:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) - n < floor:
            raise self.malformed("an opcode takes more than the stack holds")
        items = self.stack[len(self.stack) - n :]
        del self.stack[len(self.stack) - n :]
        return items

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self.malformed("an opcode wants a MARK that is not there")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items


def scan(data: bytes, path: str) -> None:
    """Refuse a pickle over budget before it is unpickled: ``DumpBudgetError``, or ``FlightRecorderError`` when
    its opcodes make no pickle. Costs one pass over the opcodes, never more than the file holds."""
    if len(data) > MAX_DUMP_BYTES:
        raise DumpBudgetError(path=path, limit=f"{MAX_DUMP_BYTES} bytes", found=f"a file of {len(data)} bytes")
    _Scan(data, path).run()


def bounded(doc: Any, path: str) -> Any:
    """``doc`` once it is known to hold at most ``MAX_NODES`` nodes, ``MAX_DEPTH`` levels deep and no cycle.

    Walks at most ``MAX_NODES`` nodes, whatever ``doc`` is: a value reached twice is walked twice, so a shared
    value counts as all it holds, and a cycle is refused where it passes the depth cap.
    """
    todo: list[tuple[Any, int]] = [(doc, 0)] if doc.__class__ in _CONTAINERS else []
    seen = 1
    while todo:
        v, depth = todo.pop()
        if depth >= MAX_DEPTH:
            raise DumpBudgetError(path=path, limit=f"{MAX_DEPTH} levels of nesting",
                                  found=f"values nested more than {MAX_DEPTH} levels deep (or a value that holds "
                                  "itself)")  # fmt: skip
        items = [*v.keys(), *v.values()] if v.__class__ is dict else v
        seen += len(items)
        if seen > MAX_NODES:
            raise DumpBudgetError(path=path, limit=f"{MAX_NODES} nodes", found=f"more than {MAX_NODES} nodes")
        todo.extend([(x, depth + 1) for x in items if x.__class__ in _CONTAINERS])
    return doc


_CONTAINERS = frozenset((dict, list, tuple, set, frozenset))
