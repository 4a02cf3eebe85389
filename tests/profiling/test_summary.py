"""``summarize``: a Profile's headline numbers, saved bytes grouped by block (``memfit.profiling.summary``)."""

from __future__ import annotations

import json

import pytest
from profiling_models import TinyGPT, gpt_inputs

from memfit.profiling.profile import StorageKind
from memfit.profiling.summary import module_group, summarize
from memfit.profiling.tracer import trace


@pytest.mark.parametrize(("path", "group"), [
    ("layers.1.fc", "layers.1"), ("model.layers.3.mlp.fc", "model.layers.3"), ("head", "head"),
    ("emb.weight_tie", "emb"), ("", "<root>"),
], ids=["block", "nested-block", "top-level", "top-level-nested", "root"])
def test_module_group(path: str, group: str) -> None:
    assert module_group(path) == group


def test_summary_of_a_gpt_groups_every_saved_activation_by_block() -> None:
    prof = trace(TinyGPT(n_layer=2), gpt_inputs(), repeats=1)
    s = summarize(prof, top=8)
    assert (s["peak_bytes"], s["saved_bytes"], s["ops"]) == (prof.peak_bytes, prof.saved_bytes, len(prof.ops))
    saved = {r["module"]: r["saved_bytes"] for r in s["saved_by_module"]}
    assert {"layers.0", "layers.1"} <= set(saved)
    assert sum(saved.values()) == sum(st.nbytes for st in prof.storages if st.saved
                                      and st.kind == StorageKind.ACTIVATION and st.created_by is not None)
    assert list(saved.values()) == sorted(saved.values(), reverse=True)
    assert summarize(prof, top=1)["saved_by_module"] == s["saved_by_module"][:1]
    json.dumps(s)  # JSON-ready, as `memfit profile --json` writes it
