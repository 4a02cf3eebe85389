"""The edge between a user's model and a traced step: finding tensors in any output, and
errors that blame the model when the model fails (NOTE [whose fault])."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

import memfit
from memfit.errors import ModelError
from memfit.profiling.modules import ModuleRecorder, param_owners
from memfit.profiling.tracer import trace
from memfit.step.inputs import default_loss, iter_tensors

A, B, C = torch.ones(2), torch.full((3,), 2.0), torch.arange(4.0)


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class Nested:
    main: Out
    extras: dict[str, torch.Tensor]
    aux: tuple[torch.Tensor, ...] = ()


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


def _hf_output() -> object:
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class CausalOut(ModelOutput):
        logits: torch.Tensor | None = None
        hidden: tuple[torch.Tensor, ...] | None = None

    return CausalOut(logits=A, hidden=(Out(B), C))


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: Out(A, 3), [A]),
        (lambda: Nested(Out(A), {"b": B}, (C,)), [A, B, C]),
        (lambda: Pair(A, Out(B)), [A, B]),
        (lambda: [Out(A), {"x": (B, Out(C))}], [A, B, C]),
        pytest.param(_hf_output, [A, B, C], marks=pytest.mark.hf),
    ],
    ids=["dataclass", "nested-dataclass", "namedtuple-of-dataclass", "list-dict-dataclass",
         "hf-model-output-of-dataclass"],
)
def test_iter_tensors_finds_every_tensor(make, expected):
    got = list(iter_tensors(make()))
    assert len(got) == len(expected)
    assert all(g is e for g, e in zip(got, expected, strict=True))


def test_default_loss_of_a_dataclass_output():
    x = torch.randn(3, 4, requires_grad=True)
    assert torch.equal(default_loss(Out(x * 2, steps=7)), (x * 2).sum())
    assert torch.equal(default_loss(Nested(Out(x), {"b": x + 1})), x.sum() + (x + 1).sum())


class Net(nn.Module):
    """Linear -> tanh -> Linear, its output wrapped as asked."""

    def __init__(self, wrap: str = "tensor") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> object:
        y = self.b(torch.tanh(self.a(x)))
        if self.wrap == "dataclass":
            return Out(y, steps=1)
        if self.wrap == "nested":
            return Nested(Out(y), {})
        return y


@pytest.mark.parametrize("wrap", ["dataclass", "nested"])
def test_profile_of_a_dataclass_output_matches_the_bare_tensor(wrap):
    x = torch.randn(4, 8)
    got, want = trace(Net(wrap), x, repeats=1), trace(Net(), x, repeats=1)
    assert got.signature == want.signature
    assert got.peak_bytes == want.peak_bytes and got.saved_bytes == want.saved_bytes
    assert [s.nbytes for s in got.storages] == [s.nbytes for s in want.storages]


# ---- the model's errors are the model's --------------------------------------------------------
def _shape_mismatch() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 4), nn.Linear(5, 2))


class Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


def _call(api: str, model: nn.Module, x: object, **kw: object) -> object:
    if api == "fit":
        return memfit.fit(model, x, budget="60%", **kw)
    return trace(model, x, mode=api.removeprefix("profile-"), repeats=1, **kw)


@pytest.mark.parametrize("api", ["profile-measure", "profile-fake", "fit"])
def test_a_model_that_raises_is_a_model_error(api):
    with pytest.raises(ModelError, match="^Sequential's forward raised RuntimeError: .*not of memfit") as e:
        _call(api, _shape_mismatch(), torch.randn(2, 8))
    assert e.value.model == "Sequential"
    assert isinstance(e.value.__cause__, RuntimeError)
    assert not isinstance(e.value.__cause__, memfit.MemfitError)


def test_a_loss_fn_that_raises_is_a_model_error():
    def loss_fn(out: object) -> torch.Tensor:
        return out.logits  # type: ignore[attr-defined]

    with pytest.raises(ModelError, match="^Net's loss_fn raised AttributeError: .*logits") as e:
        trace(Net(), torch.randn(2, 8), loss_fn=loss_fn, repeats=1)
    assert isinstance(e.value.__cause__, AttributeError)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (Doubler, "Doubler has no trainable parameter and no example input has requires_grad=True"),
        (lambda: Net().requires_grad_(False), "Net has no trainable parameter"),
    ],
    ids=["no-parameters", "frozen-parameters"],
)
@pytest.mark.parametrize("api", ["profile-measure", "profile-fake", "fit"])
def test_nothing_requires_grad_says_so(api, make, words):
    with pytest.raises(ModelError, match="nothing in .* training step requires grad") as e:
        _call(api, make(), torch.randn(2, 8))
    assert words in str(e.value)
    assert "no backward pass and nothing to checkpoint" in str(e.value)


class Detacher(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).detach()


def test_an_input_that_requires_grad_but_is_detached_says_so():
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ModelError, match="Detacher has no trainable parameter and the example "
                                         "inputs that require grad do not reach the loss"):
        trace(Detacher(), x, repeats=1)


def test_no_grad_around_the_call_says_so():
    with torch.no_grad(), pytest.raises(ModelError, match="gradients are disabled"):
        trace(Net(), torch.randn(2, 8), repeats=1)


def test_a_parameterless_model_needs_an_input_that_requires_grad():
    with pytest.raises(ModelError, match="Doubler has no trainable parameter"):
        trace(Doubler(), torch.randn(2, 8), repeats=1)
    x = torch.randn(2, 8, requires_grad=True)
    p = trace(Doubler(), x, repeats=1)
    # relu's output, saved for threshold_backward: 2 x 8 fp32 = 64 bytes
    assert p.saved_bytes == 64
    assert [o.name for o in p.forward_ops] == ["aten.relu.default", "aten.mul.Tensor", "aten.sum.default"]
    assert x.grad is None  # left as found


@pytest.mark.filterwarnings("ignore:module forward hook with ``always_call=True`` raised")
def test_a_fault_in_memfit_is_not_blamed_on_the_model(monkeypatch):
    # an AttributeError raised by memfit's own module hook while the user's forward runs
    monkeypatch.setattr(ModuleRecorder, "_sids", lambda self, obj: param_owners(obj))
    with pytest.raises(AttributeError, match="named_parameters") as e:
        trace(Net(), torch.randn(2, 8), repeats=1)
    assert not isinstance(e.value, memfit.MemfitError)
