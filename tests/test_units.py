import math

import pytest

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
