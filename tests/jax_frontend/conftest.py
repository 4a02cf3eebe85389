import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
