"""Writing per-rank traces: the writer, the schema every record follows, and where the files lie.

One flushed JSON line per record per rank (``Tracer``). The trace package
never imports the reader (``miles_fsm.replay``): the lifecycle hands the
index writer to ``Tracer`` as its ``on_close`` hook.
"""

from miles_fsm.trace.paths import index_path, trace_path
from miles_fsm.trace.schema import SCHEMA_VERSION
from miles_fsm.trace.writer import CloseHook, NullTracer, TraceIndexWarning, Tracer, TraceSink, new_run_id

__all__ = [
    "SCHEMA_VERSION",
    "CloseHook",
    "NullTracer",
    "TraceIndexWarning",
    "TraceSink",
    "Tracer",
    "index_path",
    "new_run_id",
    "trace_path",
]
