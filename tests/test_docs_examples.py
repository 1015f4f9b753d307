"""Every ```python block of README.md and docs/*.md runs, or says in the markdown why it cannot.

A block runs as written unless the line right before its fence is one of:

- ``<!-- run: SETUP -->``: it runs after the hidden setup ``SETUP`` below, which defines what the
  block takes from the reader's own code (``my_trainer_driver``, ``num_steps``, ``alc``, ...) with
  the reference drivers; ``<!-- run: SETUP, slow -->`` marks a slow one;
- ``<!-- not-run: REASON -->``: it is not run, and REASON says why (a GPU, an SGLang server, a line
  shown out of its class). The reason is visible to whoever edits the block.

A block that is neither marked nor runnable fails here. Every trace a block writes must replay as
OK: a loop that forgets to close its lifecycle replays INCOMPLETE and fails. Each block runs in a
fresh folder, so relative ``trace_dir``s land there.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles_fsm.apps.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!--\s*(run|not-run):\s*(.*?)\s*-->$")
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "run", "not-run" or None
    argument: str  # the setup's name (run) or the reason (not-run)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(before)
        out.append(Block(doc, start + 1, lang, "\n".join(lines[start + 1 : end]) + "\n",
                         marker.group(1) if marker else None, marker.group(2) if marker else ""))  # fmt: skip
        i = end + 1
    return out


BLOCKS = [b for doc in DOCS for b in _blocks(doc)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


# ----------------------------------------------------------------- the setups
#
# Each defines what its blocks use but do not define, with the reference trainer and engine on CPU
# (one rank, no process group), small enough for a block to run in well under a second.

_DRIVERS = """
import torch
from miles_fsm.drivers.cpu_memory import CpuMemorySaver
from miles_fsm.drivers.reference.trainer import ReferenceTrainer, TrainerConfig
from miles_fsm.drivers.reference.engine import ReferenceEngine

saver = CpuMemorySaver()                   # one "device", shared by trainer and engine as a GPU is
my_trainer = my_trainer_driver = trainer = ReferenceTrainer(config=TrainerConfig(), saver=saver)
my_engine = my_engine_driver = engine = ReferenceEngine(saver=saver)
num_steps = steps = 2
PROMPT_LEN = 4
prompts = torch.randint(0, trainer.config.model.vocab, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(0))

def generate(prompts=prompts):
    return my_engine.generate(prompts, max_new_tokens=4)

_last = {"rollouts": torch.cat([prompts, prompts], dim=1)}

def train_step(rollouts=None):
    rollouts = _last["rollouts"] if rollouts is None else rollouts
    _last["rollouts"] = rollouts
    reward = (rollouts[:, PROMPT_LEN:] % 2 == 0).float().sum(dim=1)
    return trainer.train_step(rollouts, reward - reward.mean(), prompt_len=PROMPT_LEN)

rollouts = rollout_data = _last["rollouts"]
"""

_STARTED = _DRIVERS + """
from miles_fsm import Lifecycle, LifecycleConfig
lc = lifecycle = Lifecycle(trainer=trainer, engine=engine, config=LifecycleConfig(trace_dir="traces"))
lifecycle.start()
"""

# A miles-style actor and rollout manager over the started lifecycle's drivers.
_MILES = _STARTED + """
class _Actor:
    def train(self, rollout_data):
        return train_step(rollout_data)

class _RolloutManager:
    def generate(self):
        return generate()

actor, rollout_manager = _Actor(), _RolloutManager()
"""

_ASYNC = _DRIVERS + """
import anyio
from miles_fsm import Lifecycle, LifecycleConfig
from miles_fsm import AsyncLifecycle

lifecycle = Lifecycle(trainer=trainer, engine=engine, config=LifecycleConfig(trace_dir="traces"))

async def generate_all(engine, prompts):
    return await anyio.to_thread.run_sync(generate, prompts)
"""


@dataclass(frozen=True)
class Setup:
    before: str
    after: str = ""  # run after the block, in its namespace
    wrap_async: bool = False  # the block is a fragment of an async function: run it inside one
    subprocess: bool = False  # the block patches the process for good: run it in a fresh interpreter
    needs: str | None = None  # a module it cannot run without (skipped, with the reason, where it is absent)


SETUPS = {
    # The reader's trainer and engine drivers, their step count and train/generate calls.
    "reference-drivers": Setup(_DRIVERS),
    # ... and a started lifecycle over them, `lc` / `lifecycle`, closed after the block.
    "started-lifecycle": Setup(_STARTED, after="lifecycle.close()"),
    # ... and a miles-style `actor` and `rollout_manager`; the block must close the lifecycle itself.
    "miles-actor": Setup(_MILES),
    # `lifecycle` (not started), `engine`, `prompts`, `generate_all` and `train_step` for an async loop.
    "async-loop": Setup(_ASYNC),
    # Inside an async function: `alc` in REMATERIALIZED, then brought back to TRAINING and closed.
    "async-rematerialized": Setup(
        _ASYNC + "alc = AsyncLifecycle(lifecycle)\nlifecycle.start(); lifecycle.offload(); lifecycle.pause()\n"
        "lifecycle.rematerialize()\n",
        after="await alc.resume()\nlifecycle.close()",
        wrap_async=True,
    ),
    # Inside an async function: `alc` in PAUSED and two batches of `requests` for an engine server.
    "async-paused": Setup(
        _ASYNC + "from miles_fsm import State\nalc = AsyncLifecycle(lifecycle)\n"
        "lifecycle.start(); lifecycle.offload(); lifecycle.pause()\n"
        "class _Engine:  # the reader's engine: generate(batch)\n    def generate(self, batch):\n        return generate(batch)\n"
        "engine = _Engine()\n"
        "async def _requests():\n    for p in (prompts[:2], prompts[2:]):\n        yield p\nrequests = _requests()\n",
        after="await engine_server()\nawait alc.rematerialize(); await alc.sync(); await alc.resume()\n"
        "lifecycle.close()",
        wrap_async=True,
    ),
    # A pytest module: written to a file and run by pytest, with an `alc` fixture (a started lifecycle).
    "pytest-module": Setup(""),
    # A fresh interpreter running the block as its main script: a block that starts ranks with run_ranks, whose
    # processes import that script (the block's `if __name__ == "__main__":` keeps them from launching again).
    "launcher": Setup("", subprocess=True),
    # A fresh interpreter: megatron_cpu.enable() patches the process for good.
    "fresh-process": Setup("", subprocess=True, needs="megatron.core"),
    # A fresh interpreter with a one-rank gloo process group, for megatron-core's model.
    "megatron-cpu": Setup(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "from miles_fsm import Lifecycle, LifecycleConfig, VerifyConfig\n"
        "from miles_fsm.drivers.megatron.cpu import build_cpu_gpt_trainer\nsteps = 2\n",
        after="dist.destroy_process_group()",
        subprocess=True,
        needs="megatron.core",
    ),
}

_ALC_CONFTEST = """
import pytest
from miles_fsm import Lifecycle, LifecycleConfig
from miles_fsm.drivers.cpu_memory import CpuMemorySaver
from miles_fsm.drivers.reference.trainer import ReferenceTrainer
from miles_fsm.drivers.reference.engine import ReferenceEngine
from miles_fsm import AsyncLifecycle


@pytest.fixture
def alc(tmp_path):
    saver = CpuMemorySaver()
    lc = Lifecycle(trainer=ReferenceTrainer(saver=saver), engine=ReferenceEngine(saver=saver),
                   config=LifecycleConfig(trace_dir=tmp_path))
    with lc:
        lc.start()
        yield AsyncLifecycle(lc)
"""


# ------------------------------------------------------------------ the checks


def _marked(marker: str) -> list:
    out = []
    for b in PYTHON:
        if b.marker != marker:
            continue
        slow = marker == "run" and "slow" in [a.strip() for a in b.argument.split(",")[1:]]
        out.append(pytest.param(b, id=b.where, marks=[pytest.mark.slow] if slow else []))
    return out


RUNNABLE = [pytest.param(b, id=b.where) for b in PYTHON if b.marker is None] + _marked("run")


def test_every_python_block_is_runnable_or_says_why_not():
    """The docs hold python blocks, each either run here or marked not-run with a reason a reader can
    judge; a run marker names a setup that exists."""
    assert len(PYTHON) >= 20, [b.where for b in PYTHON]
    for b in PYTHON:
        if b.marker == "not-run":
            assert len(b.argument) >= 15, f"{b.where}: not-run needs a reason, got {b.argument!r}"
        elif b.marker == "run":
            name = b.argument.split(",")[0].strip()
            assert name in SETUPS, f"{b.where}: unknown setup {name!r}; known: {sorted(SETUPS)}"


def test_no_python_hides_in_a_block_without_a_language():
    """A Python block with no language tag would escape this test: tag it ```python."""
    for b in BLOCKS:
        if b.lang in ("", "text"):
            first = b.code.lstrip().split("\n", 1)[0]
            assert not re.match(r"(from \S+ import|import \S+$|def |class |async def )", first), b.where


@pytest.mark.parametrize("block", RUNNABLE)
def test_the_block_runs_and_its_traces_replay_ok(block, tmp_path, monkeypatch, capsys):
    """The block runs (after its setup), and every trace it leaves replays OK (exit 0)."""
    name = block.argument.split(",")[0].strip() if block.marker == "run" else None
    setup = SETUPS[name] if name else Setup("")
    if setup.needs and importlib.util.find_spec(setup.needs.split(".")[0]) is None:
        pytest.skip(f"{block.where} needs {setup.needs}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if name == "pytest-module":
        _run_pytest_module(block, tmp_path)
    elif setup.subprocess:
        _run_in_fresh_process(block, setup, tmp_path)
    else:
        _run_here(block, setup)
    traces = sorted({p.parent for p in tmp_path.rglob("rank-*.jsonl")})
    if "trace_dir" in block.code:
        assert traces, f"{block.where} sets a trace_dir but wrote no trace"
    capsys.readouterr()
    for d in traces:
        code = main(["replay", str(d)])
        out = capsys.readouterr().out
        assert code == 0 and out.startswith("OK"), f"{block.where}: replay of {d} (exit {code}):\n{out}"


def _source(block: Block, setup: Setup) -> tuple[str, str, str]:
    """The setup, the block (its line numbers the markdown's) and what runs after it."""
    return textwrap.dedent(setup.before), "\n" * block.line + block.code, textwrap.dedent(setup.after)


def _run_here(block: Block, setup: Setup) -> None:
    before, code, after = _source(block, setup)
    ns: dict = {"__name__": "__doc_block__"}
    exec(compile(before, "<setup>", "exec"), ns)
    if not setup.wrap_async:
        exec(compile(code, block.where, "exec"), ns)
        exec(compile(after, "<after>", "exec"), ns)
        return
    # The block is a fragment of an async function: make it one, line numbers kept.
    body = textwrap.indent(code + "\n" + after + "\n", "    ")
    exec(compile("async def __block__():\n" + body.split("\n", 1)[1], block.where, "exec"), ns)
    import anyio

    anyio.run(ns["__block__"])


def _run_in_fresh_process(block: Block, setup: Setup, tmp_path: Path) -> None:
    before, code, after = _source(block, setup)
    script = tmp_path / "block.py"
    script.write_text(f"{before}\nexec(compile({code!r}, {block.where!r}, 'exec'))\n{after}\n")
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:miles_fsm", str(script)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, f"{block.where}:\n{done.stdout}\n{done.stderr}"


def _run_pytest_module(block: Block, tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_ALC_CONFTEST)
    (tmp_path / "test_doc_block.py").write_text(block.code)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "--basetemp", str(tmp_path / "pytest"), str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, f"{block.where}, run by pytest:\n{done.stdout}\n{done.stderr}"
    assert re.search(r"\b[1-9]\d* passed\b", done.stdout) and "failed" not in done.stdout, done.stdout


@pytest.mark.slow
def test_the_async_example_leaves_traces_that_replay_ok(tmp_path, capsys):
    """examples/async_rollout_loop.py, run as its docstring says with --trace-dir: its closed trace replays OK
    (examples/ray_actor.py writes no trace; tests/test_ray.py runs it)."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "async_rollout_loop.py"), "--steps", "1", "--json",
                           "--trace-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert main(["replay", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("OK: 1 rank(s)")


#: What a driver author names in a driver's signatures: the protocols' own argument and return types.
DRIVER_TYPES = ("TrainerDriver", "EngineDriver", "RematerializingTrainer", "Strategy", "StepReport", "Step", "StepKind",
                "Collective", "TensorSet")  # fmt: skip


def test_every_type_a_driver_author_names_is_public_and_in_the_guides_examples():
    """Each type of the driver protocols' signatures imports from ``miles_fsm``, and docs/embedding.md's
    examples use it (issue 37: ``Collective`` and ``TensorSet`` lived only in ``miles_fsm.plan``)."""
    import miles_fsm
    from miles_fsm.states import protocols

    guide = ROOT / "docs" / "embedding.md"
    text = "\n".join(b.code for b in PYTHON if b.doc == guide) + "\n".join(
        line for line in guide.read_text().splitlines() if "`" in line)  # fmt: skip
    for name in DRIVER_TYPES:
        assert name in miles_fsm.__all__, f"{name} is not on the top level"
        assert re.search(rf"\b{name}\b", text), f"docs/embedding.md never shows {name}"
    named = set()
    for proto in (protocols.TrainerDriver, protocols.RematerializingTrainer, protocols.EngineDriver):
        for member in vars(proto).values():
            fn = member.fget if isinstance(member, property) else member
            named |= set(re.findall(r"\b[A-Z]\w+\b", " ".join(map(str, getattr(fn, "__annotations__", {}).values()))))
    assert named - {"Iterable", "Mapping", "None"} - {"Tensor"} <= set(DRIVER_TYPES), named
