"""fit's option families (NOTE [fit's option families] in memfit.job.fit_options): each value
checked when made, the old keywords folded in with a DeprecationWarning that spells the new value,
and the same plan either way."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import memfit
from memfit.job.fit_options import OLD_FIT_KEYWORDS, Parallel, Search, Training, resolve_fit_options
from memfit.runtime.apply import input_guard


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
                                 for _ in range(4)))


def test_fit_takes_the_step_the_cap_and_three_option_values():
    params = inspect.signature(memfit.fit).parameters
    named = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert named == ["model", "example_inputs", "job", "budget", "loss_fn", "step", "search",
                     "training", "parallel"]


def test_every_old_keyword_is_a_field_of_the_value_that_replaces_it():
    for key, (cls, name) in OLD_FIT_KEYWORDS.items():
        assert name == key and name in cls.__dataclass_fields__


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: Search(solver="fastest"), ValueError, "unknown solver 'fastest'; choose one of auto"),
    (lambda: Search(tune="yes"), TypeError, "tune must be True or False"),
    (lambda: Search(tune_time_limit_s=0), ValueError, "tune_time_limit_s must be > 0"),
    (lambda: Search(compress="zip"), ValueError, "compress must be one of"),
    (lambda: Search(lossy_codec="fp8_e4m3"), ValueError, "pass compress='lossy' too"),
    (lambda: Training(on_new_shape="ignore"), ValueError, "on_new_shape must be one of"),
    (lambda: Training(shapes=()), TypeError, "shapes must be a non-empty list"),
    (lambda: Training(monitor_every=0), ValueError, "monitor_every must be an int >= 1"),
    (lambda: Parallel(src=-1), ValueError, "src must be a global rank"),
    (lambda: Parallel(in_flight=0), ValueError, "in_flight must be an int >= 1"),
    (lambda: Parallel(kept_bytes=8), ValueError, "kept_bytes is a pipeline stage's"),
], ids=["solver", "tune", "time-limit", "compress", "codec", "on-new-shape", "shapes", "monitor",
        "src", "in-flight", "kept-bytes"])
def test_a_value_that_describes_nothing_is_refused_when_made(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_values_print_as_the_call_that_makes_them():
    assert repr(Search()) == "Search()"
    assert repr(Search(solver="milp", tune=True)) == "Search(solver='milp', tune=True)"
    assert repr(Training(monitor_every=25)) == "Training(monitor_every=25)"
    assert repr(Parallel(in_flight=4, kept_bytes=1024)) == "Parallel(in_flight=4, kept_bytes=1024)"


def test_old_keywords_warn_with_the_new_spelling_and_make_the_same_values():
    with pytest.warns(DeprecationWarning) as seen:
        values = resolve_fit_options(None, None, None, {"solver": "chain", "tune": False,
                                                        "monitor_every": 5, "in_flight": 2})
    messages = sorted(str(w.message) for w in seen)
    assert messages == [
        "fit(in_flight=2) is deprecated: pass parallel=memfit.Parallel(in_flight=2)",
        "fit(monitor_every=5) is deprecated: pass training=memfit.Training(monitor_every=5)",
        "fit(solver='chain', tune=False) is deprecated: pass "
        "search=memfit.Search(solver='chain', tune=False)",
    ]
    assert values == (Search(solver="chain"), Training(monitor_every=5), Parallel(in_flight=2))


def test_an_old_keyword_beside_its_value_or_a_wrong_type_is_refused():
    with pytest.raises(TypeError, match=r"fit\(\) got search= and solver='chain'"):
        resolve_fit_options(Search(), None, None, {"solver": "chain"})
    with pytest.raises(TypeError, match="fit's training= must be a memfit.Training, got Search"):
        resolve_fit_options(None, Search(), None, {})  # type: ignore[arg-type]


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return memfit.zoo.gpt(n_layer=4, d_model=64, n_head=4, seq_len=64, vocab_size=256)


def test_fit_with_old_keywords_plans_what_the_new_spelling_plans():
    """Fake mode for a preset: no clock, so the two fits see the same profile."""
    x = torch.zeros(4, 64, dtype=torch.long, device="meta")
    new = memfit.fit(_meta_gpt(), x, budget=0.5, search=memfit.Search(solver="chain", target="h100"),
                     training=memfit.Training(on_new_shape="raise"))
    with pytest.warns(DeprecationWarning, match=r"pass search=memfit.Search\(solver='chain', target='h100'\)"):
        old = memfit.fit(_meta_gpt(), x, budget=0.5, solver="chain", target="h100",
                         on_new_shape="raise")
    assert old.memfit_plan.regions and old.memfit_plan.to_dict() == new.memfit_plan.to_dict()
    assert input_guard(old).settings() == input_guard(new).settings()
    assert input_guard(old).settings()["on_new_shape"] == "raise"


def test_fit_refuses_an_unknown_keyword_as_python_does():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="fit\\(\\) got an unexpected keyword argument 'solvr'"):
            memfit.fit(_model(), torch.randn(8, 32), budget=0.6, solvr="chain")
