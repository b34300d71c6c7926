"""[Note: torch's fast paths in checked steps]: the checking mode is off the stack for the forward of torch's modules
with a fast path, out of training mode, and back after, however the forward ends."""

import copy
import io

import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from lightning_chunk.engine.runtime import fast_paths
from lightning_chunk.engine.runtime.reads import ReleasedReads


class Other(TorchFunctionMode):
    """A user's mode: it stays where it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def encoder() -> torch.nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    fused = torch._native_multi_head_attention
    monkeypatch.setattr(torch, "_native_multi_head_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    return calls


def test_the_checking_mode_is_off_in_evaluation_only_and_back_after(monkeypatch):
    calls = fused_calls(monkeypatch)
    model, x = encoder(), torch.randn(2, 5, 16)
    fast_paths.install(model)
    checking, other = ReleasedReads(lambda t: None), Other()
    with torch.no_grad():
        model.eval()
        plain = model(x)
        assert len(calls) == 2  # one a layer, with no mode on the stack
        with checking:
            assert torch.equal(model(x), plain)
            assert len(calls) == 4
            assert _get_current_function_mode_stack() == [checking]
            model.train()  # no fast path in training: the check stays for the forward
            model(x)
            assert len(calls) == 4
        model.eval()
        with other, checking:  # a user's mode keeps the fast path off, as without the engine; it stays in place
            model(x)
            assert len(calls) == 4
            assert _get_current_function_mode_stack() == [other, checking]


def test_a_forward_that_raises_puts_the_mode_back(monkeypatch):
    model = encoder().eval()
    fast_paths.install(model)
    checking = ReleasedReads(lambda t: None)
    with checking:
        with pytest.raises(AssertionError):
            model(torch.randn(2, 5, 15))  # the wrong width
        assert _get_current_function_mode_stack() == [checking]
    assert fast_paths._calls() == []


def test_a_hooked_module_copies_and_pickles():
    """The hooks are plain functions: a copy (an EMA's, a callback's) takes them by reference."""
    model = encoder().eval()
    fast_paths.install(model)
    copied = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(copied(x), model(x)) and torch.equal(loaded(x), model(x))
