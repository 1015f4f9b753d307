"""One ``sglang.launch_server`` process group on this host's GPU, started and always stopped.

The server starts in a session of its own so that ``stop`` reaches its
scheduler and detokenizer too. It is up in two stages: ``/model_info``
answers once the scheduler has allocated its weights and KV cache (from then
on, other allocations on the GPU no longer shrink SGLang's memory pool), and
``/health`` once its warmup request has run (kernel JIT: ~50 s on a fresh
host). The trainer is built between the two.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miles_fsm.drivers.errors import EngineRequestError

__all__ = ["SERVER_FLAGS", "SGLangServer", "free_port", "server_env", "stop_process_group"]

#: ``../shared/sglang-h200/README.md``'s flags: no tokenizer (requests send ids), triton attention,
#: the memory saver on; bf16 named, so that a config without a dtype cannot fall back to fp16.
SERVER_FLAGS = (
    "--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
    "--sampling-backend", "pytorch", "--grammar-backend", "none", "--disable-cuda-graph",
    "--enable-memory-saver", "--dtype", "bfloat16", "--host", "127.0.0.1",
)  # fmt: skip


def free_port() -> int:
    """A TCP port free on the loopback now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env() -> dict[str, str]:
    """The server's environment: the memory saver's preload library needs torch's CUDA runtime on the path."""
    import torch

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
    cuda_lib = Path(torch.__file__).resolve().parent.parent / "nvidia" / "cu13" / "lib"
    if cuda_lib.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(cuda_lib), env.get("LD_LIBRARY_PATH")) if p)
    return env


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """TERM, then KILL, the process group ``proc`` leads (started with ``start_new_session``); idempotent."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the group may outlive its leader (scheduler, detokenizer)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class SGLangServer:
    """A server over a model directory holding only ``config.json`` (dummy weights)."""

    def __init__(self, *, config: dict[str, Any], workdir: Path, log_path: Path, mem_fraction: float) -> None:
        self.model_dir = workdir / "model"
        self.model_dir.mkdir(parents=True, exist_ok=True)
        (self.model_dir / "config.json").write_text(json.dumps(config, indent=1))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                     *SERVER_FLAGS, "--mem-fraction-static", str(mem_fraction), "--port", str(self.port)]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0
        self.timings: dict[str, float] = {}

    def launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.t0 = time.monotonic()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                         start_new_session=True)  # fmt: skip

    def wait(self, path: str, timeout_s: float) -> float:
        """Poll ``GET path`` until it answers 200; the seconds since launch. Fails with the log's tail."""
        import httpx

        while time.monotonic() - self.t0 < timeout_s:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise EngineRequestError(engine=self.url, op=f"launch_server (waiting for {path})", status=None,
                                         message=f"the server exited with {code}:\n{self.log_tail()}")  # fmt: skip
            try:
                if httpx.get(f"{self.url}{path}", timeout=5).status_code == 200:
                    self.timings[path] = round(time.monotonic() - self.t0, 2)
                    return self.timings[path]
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(1.0)
        raise EngineRequestError(engine=self.url, op=f"launch_server (waiting for {path})", status=None,
                                 message=f"no answer after {timeout_s:.0f} s:\n{self.log_tail()}")  # fmt: skip

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """TERM, then KILL, the whole process group; idempotent."""
        if self.proc is not None:
            stop_process_group(self.proc)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def post(self, path: str, body: dict[str, Any], *, timeout_s: float) -> Any:
        """POST and return the JSON; a refusal or a dead server is an ``EngineRequestError`` with the log's tail."""
        import httpx

        try:
            r = httpx.post(f"{self.url}{path}", json=body, timeout=timeout_s)
        except httpx.TransportError as exc:
            raise EngineRequestError(engine=self.url, op=path, status=None,
                                     message=f"{type(exc).__name__}: {exc}\n{self.log_tail(15)}") from exc  # fmt: skip
        if r.status_code != 200:
            raise EngineRequestError(engine=self.url, op=path, status=r.status_code,
                                     message=f"{r.text[:500]}\n{self.log_tail(15)}")  # fmt: skip
        return r.json()
