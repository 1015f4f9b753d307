"""docs/embedding.md, "`torch.optim` state under a saver tag": the CPU recipe, run as written."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from miles_fsm.drivers.cpu_memory import CpuMemorySaver

DOC = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


def _recipe():
    """The ``optimizer_state_under`` block of the doc, executed."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (code,) = [b for b in blocks if "def optimizer_state_under" in b]
    namespace: dict = {"torch": torch}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace["optimizer_state_under"]


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("foreach", [False, True])
def test_paused_default_frees_adam_state_and_it_comes_back_bit_exact(foreach):
    """After the doc's recipe, Adam's state lives under ``default``: pausing the tag leaves every state
    tensor without memory, and after resume the next steps match a never-paused twin bit for bit."""
    optimizer_state_under = _recipe()
    saver = CpuMemorySaver()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=foreach)
    _step(model, opt, 0)  # the first step allocates the state, lazily
    _step(twin, opt_twin, 0)
    optimizer_state_under(saver, opt)

    state = [t for s in opt.state.values() for t in s.values()]
    nbytes = sum(t.numel() * t.element_size() for t in state)
    assert saver.resident_bytes(["default"]) == nbytes > 0
    opt.zero_grad(set_to_none=True)  # no grads held while paused
    saver.pause("default")
    assert saver.resident_bytes(["default"]) == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    saver.resume("default")
    for seed in (1, 2):
        _step(model, opt, seed)
        _step(twin, opt_twin, seed)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(x, y) for s, t in zip(opt.state.values(), opt_twin.state.values())
               for x, y in zip(s.values(), t.values()))  # fmt: skip


def test_without_the_recipe_pausing_default_frees_nothing():
    """The control: state the first step allocated outside any region survives a pause of
    ``default`` untouched, so the recipe is what makes the pause free it."""
    saver = CpuMemorySaver()
    saver.empty("default", 4, torch.float32, backup=True)  # the tag exists, the state is elsewhere
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, opt, 0)
    saver.pause("default")
    assert all(t.untyped_storage().nbytes() > 0 for s in opt.state.values() for t in s.values())
