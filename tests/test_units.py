import math

import numpy as np
import pytest
import torch

from memfit.units import format_bytes, format_seconds, parse_bytes, resolve_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("6GiB", 6 * 1024**3),
        ("500MB", 500 * 1000**2),
        ("1.5 GB", 1_500_000_000),
        ("1.5 KiB", 1536),
        ("2 mib", 2 * 1024**2),
        ("3g", 3 * 1000**3),
        ("7 B", 7),
    ],
    ids=str,
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "1.2.3GB", "5 parsecs", "-1GB", "0", "0 MiB"], ids=repr)
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="memory size|cannot parse"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (0.5, 500),
        (1.0, 1000),
        (1, 1),
        (750, 750),
        ("80%", 800),
        ("0.25", 250),
        ("2KiB", 2048),
        ("1.5 KB", 1500),
    ],
    ids=repr,
)
def test_resolve_budget(budget, expected):
    assert resolve_budget(budget, 1000) == expected


@pytest.mark.parametrize(
    "budget", [0, -5, 0.0, 1.5, -0.1, math.nan, math.inf, "abc", "", "120%x", True], ids=repr
)
def test_resolve_budget_rejects(budget):
    with pytest.raises((ValueError, TypeError)):
        resolve_budget(budget, 1000)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (np.int64(750), 750),
        (np.int32(750), 750),
        (np.uint64(750), 750),
        (np.float32(0.5), 500),
        (np.float16(1.0), 1000),
        (np.array(750), 750),
        (np.array(0.5), 500),
        (torch.tensor(0.5), 500),
    ],
    ids=["int64", "int32", "uint64", "float32", "float16", "0d-int-array",
         "0d-float-array", "0d-tensor"],
)
def test_resolve_budget_accepts_numpy_numbers(budget, expected):
    got = resolve_budget(budget, 1000)
    assert got == expected and type(got) is int


@pytest.mark.parametrize(
    ("budget", "error", "message"),
    [
        (np.bool_(True), TypeError, "not bool"),
        (np.array([1, 2]), TypeError, r"one number, got ndarray of shape \(2,\)"),
        (np.int64(0), ValueError, "must be positive bytes, got 0"),
        (np.float32(1.5), ValueError, r"must lie in \(0, 1\], got 1.5"),
    ],
    ids=["bool", "array", "zero", "fraction-over-1"],
)
def test_resolve_budget_numpy_rejects(budget, error, message):
    with pytest.raises(error, match=message):
        resolve_budget(budget, 1000)


@pytest.mark.parametrize(
    ("budget", "shown"),
    [("150%", "'150%'"), (" 0% ", "'0%'"), ("-20%", "'-20%'"), ("nan%", "'nan%'")],
    ids=["150", "zero", "negative", "nan"],
)
def test_percentage_out_of_range_is_reported_as_written(budget, shown):
    with pytest.raises(ValueError, match=r"percentage budget .* \(0%, 100%\], got " + shown) as e:
        resolve_budget(budget, 1000)
    assert "1.5" not in str(e.value) and "0.0" not in str(e.value)


def test_resolve_budget_type_error():
    with pytest.raises(TypeError, match="budget must be"):
        resolve_budget([1], 1000)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (3 * 1024**3, "3.00 GiB"), (-2048, "-2.00 KiB")]
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_seconds():
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(2.5) == "2.50 s"
    assert format_seconds(5e-6) == "5 us"


def test_numpy_budgets_reach_plan_and_fit():
    import memfit
    from memfit import zoo
    from memfit.profiling.tracer import trace

    model = zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    x = zoo.example_inputs(model, batch=2)
    prof = trace(model, x, repeats=1)
    by_bytes = memfit.plan(prof, budget=np.int64(prof.peak_bytes))
    assert by_bytes.budget_bytes == prof.peak_bytes and type(by_bytes.budget_bytes) is int
    memfit.fit(model, x, budget=np.float32(0.9))
    assert model.memfit_plan.budget_bytes == int(float(np.float32(0.9)) * model.memfit_plan.plain_peak_bytes)
