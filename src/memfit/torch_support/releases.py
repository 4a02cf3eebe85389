"""The torch releases memfit supports: the range its test suite has passed on (NOTE [private
torch APIs] in ``memfit._torch``, rule 0); what memfit can do on the installed one is
``memfit.torch_support.capabilities`` (NOTE [features by torch release] there)."""

from __future__ import annotations

import logging
import re

import torch

from memfit.errors import UnsupportedTorch

__all__ = ["SUPPORTED_TORCH", "torch_release", "require_supported_torch"]

log = logging.getLogger(__name__)

# Rule 0: the oldest and newest (major, minor) releases the suite has passed on, and the
# versions it passed with. pyproject.toml declares the same range (a test checks it).
_OLDEST = (2, 9)
_NEWEST = (2, 15)
_TESTED = "2.9.1, 2.11.0, 2.13.0, 2.14.1, 2.15.0"
SUPPORTED_TORCH = f">={_OLDEST[0]}.{_OLDEST[1]},<{_NEWEST[0]}.{_NEWEST[1] + 1}"


def torch_release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``"2.14.1+cpu"``, ``"2.16.0.dev20260101"``
    -> ``(2, 14)``, ``(2, 16)``); None if it does not start with two numbers."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def require_supported_torch() -> None:
    """Raise ``UnsupportedTorch`` if the installed torch is older than ``SUPPORTED_TORCH``;
    log a warning if it is newer (NOTE [private torch APIs], rule 0). Called when this module
    is first imported."""
    version = torch.__version__
    release = torch_release(version)
    if release is None:
        log.warning("cannot tell the release of torch %r; memfit supports torch %s",
                    version, SUPPORTED_TORCH)
        return
    if release < _OLDEST:
        raise UnsupportedTorch(
            f"memfit needs torch {SUPPORTED_TORCH}, but torch {version} is installed (memfit "
            f"is tested with {_TESTED}): install a supported torch, e.g. "
            f"pip install 'torch{SUPPORTED_TORCH}'"
        )
    if release > _NEWEST:
        log.warning("torch %s is newer than the releases memfit is tested with (%s, "
                    "supported %s); memfit checks the private APIs it needs, but was not "
                    "tested on this torch", version, _TESTED, SUPPORTED_TORCH)
