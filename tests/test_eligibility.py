"""``rematerialize_eligibility`` on plain ``torch.nn`` modules (no megatron): what is outside, and the hints."""

from __future__ import annotations

import doctest
import pickle

import pytest
import torch

import miles_fsm.drivers.eligibility as eligibility
from miles_fsm.drivers.eligibility import rematerialize_eligibility
from miles_fsm.drivers.errors import IneligibleModelError


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


def _buffered(net: _Net) -> set[int]:
    """As if a DDP buffer held every trainable param that existed when it was built."""
    return {id(p) for p in net.parameters() if p.requires_grad}


def test_a_module_whose_params_are_all_buffered_is_eligible():
    """Every param in a buffer: eligible, nothing reported, and raise_if_ineligible is silent."""
    net = _Net()
    e = rematerialize_eligibility(net, in_buffers=_buffered(net))
    assert e.eligible and e.names == () and e.unknown_extras == ()
    e.raise_if_ineligible()


def test_a_frozen_param_is_named_with_the_frozen_suggestion():
    """A frozen param outside the buffers is reported by name, flagged frozen, told its three fixes."""
    net = _Net()
    net.norm.weight.requires_grad_(False)
    e = rematerialize_eligibility(net, in_buffers=_buffered(net))
    assert e.names == ("norm.weight",)
    (o,) = e.outside
    assert o.frozen
    assert o.suggestion.startswith("frozen (requires_grad=False): DDP skips it")
    for fix in ("unfreeze it", "among the extras", "backup strategy"):
        assert fix in o.suggestion
    assert "frozen" in e.reason


def test_a_trainable_param_outside_the_buffers_is_not_called_frozen():
    """A trainable param no buffer holds (added after DDP was built) gets the 'not registered' hint,
    and a mix of kinds gets the general reason."""
    net = _Net()
    net.norm.weight.requires_grad_(False)
    in_buffers = _buffered(net)
    net.head = torch.nn.Linear(4, 2)  # after the buffers were "built"
    e = rematerialize_eligibility(net, in_buffers=in_buffers)
    assert e.names == ("norm.weight", "head.weight", "head.bias")
    assert [o.frozen for o in e.outside] == [True, False, False]
    assert e.outside[1].suggestion.startswith("not registered in a DDP param buffer")
    assert e.reason.startswith("not in any DDP param buffer")


def test_extras_accept_params_outside_the_buffers():
    """A param outside the buffers but named among the extras is eligible (it gets a host copy)."""
    net = _Net()
    net.norm.weight.requires_grad_(False)
    e = rematerialize_eligibility(net, in_buffers=_buffered(net), extras=["norm.weight"])
    assert e.eligible


def test_a_misnamed_extra_suggests_the_param_it_was_meant_for():
    """A misspelt extra names no param: it is reported with the close name, and the refused param's
    suggestion points back at the misspelt extra."""
    net = _Net()
    net.norm.weight.requires_grad_(False)
    e = rematerialize_eligibility(net, in_buffers=_buffered(net), extras=["norm.wieght"])
    assert e.names == ("norm.weight",)
    (unknown,) = e.unknown_extras
    assert unknown.name == "norm.wieght" and unknown.close[0] == "norm.weight"
    assert "did you mean 'norm.weight'" in unknown.hint
    assert "the extras name 'norm.wieght', which no param has" in e.outside[0].suggestion


def test_an_extra_missing_its_prefix_is_matched_by_suffix():
    """An extra given without the wrapper's prefix (``module.``) is matched to the full name."""
    wrapped = torch.nn.Module()
    wrapped.module = _Net()
    wrapped.module.norm.bias.requires_grad_(False)
    e = rematerialize_eligibility(wrapped, in_buffers=_buffered(wrapped.module), extras=["norm.bias"])
    assert e.unknown_extras[0].close == ("module.norm.bias",)


def test_raise_if_ineligible_names_every_param_with_its_suggestion():
    """The error carries the names and one suggestion per name, shows them, and pickles as itself."""
    net = _Net()
    for p in net.norm.parameters():
        p.requires_grad_(False)
    e = rematerialize_eligibility(net, in_buffers=_buffered(net))
    with pytest.raises(IneligibleModelError) as info:
        e.raise_if_ineligible()
    err = info.value
    assert err.params == ("norm.weight", "norm.bias")
    assert err.suggestions == tuple(o.suggestion for o in e.outside)
    assert "norm.bias: frozen (requires_grad=False)" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert again.suggestions == err.suggestions and str(again) == str(err)


def test_in_buffers_as_a_predicate_and_named_params():
    """``in_buffers`` may be a predicate, and ``module`` an iterable of named tensors."""
    flat = torch.zeros(6)
    named = [("a", flat[:3]), ("b", flat[3:]), ("c", torch.zeros(2))]
    ptr = flat.untyped_storage().data_ptr()
    e = rematerialize_eligibility(named, in_buffers=lambda t: t.untyped_storage().data_ptr() == ptr)
    assert e.names == ("c",)


def test_the_module_doctest_runs():
    """The example in the module's docstring is true."""
    result = doctest.testmod(eligibility)
    assert result.attempted > 0 and result.failed == 0
