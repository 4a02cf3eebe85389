"""Suite-wide: keep the objects that outlive each test out of the garbage collector's sight.

NOTE [a frozen collector in tests]
    memfit runs a full garbage collection before every metered or timed step
    (``memfit.profiling.measure``; ``memfit.measuring.calibration``: about 13 per calibrated
    profile; ``memfit.measuring.tuning``). A full collection walks every object the process
    tracks, and a test worker that has imported torch, transformers, MONAI and Lightning and
    run hundreds of tests tracks millions: measured, 39 collections took 11.9 s of a 19 s
    test of ``tests/runtime/test_runtime_inplace.py``. So after collection and after each
    test, the objects that survived a collection are frozen (``gc.freeze``): later
    collections skip them, and the garbage a test makes is still collected. The library is
    unchanged; ``tests/test_breadth.py`` did the same for its own module first.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


def _freeze_survivors() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """NOTE [features by torch release] (memfit.torch_support.capabilities): a test marked
    ``torch_feature(name)`` tests a feature that some releases refuse; on those it must raise
    ``UnsupportedTorch`` (a strict xfail: a pass or another error fails the suite)."""
    marked = [(item, m.args[0]) for item in items for m in item.iter_markers("torch_feature")]
    if not marked:
        return
    from memfit.errors import UnsupportedTorch
    from memfit.torch_support.capabilities import capabilities

    caps = capabilities()
    for item, feature in marked:
        if caps.status(feature) == "refused":
            item.add_marker(pytest.mark.xfail(
                raises=UnsupportedTorch, strict=True,
                reason=f"{feature} is refused on torch {caps.torch_version}"))


def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_survivors()  # the imported libraries and the collected tests


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's fixtures torn down
    _freeze_survivors()  # what the test imported or cached (modules, module-scoped fixtures)
