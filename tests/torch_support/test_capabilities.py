"""``memfit.capabilities()``: one row per feature the installed torch decides (NOTE [features
by torch release] in ``memfit.torch_support.capabilities``), and ``memfit doctor`` printing the same rows."""

from __future__ import annotations

import json

import pytest
import torch

import memfit
from memfit import _torch as T
from memfit.cli.main import main
from memfit.errors import UnsupportedTorch
from memfit.runtime.policies import by_key

FEATURES = ["torch release", "selective regions", "op outputs seen by the policy",
            "another backward through a region", "offload", "chain segments",
            "saved-tensor hooks around regions", "profiler ranges in a replay", "pipeline schedules",
            "GPU-faithful fake mode", "CUDA peak meter"]


def test_the_rows_are_this_torch_s():
    caps = memfit.capabilities()
    assert caps.torch_version == torch.__version__
    assert [r.feature for r in caps.rows] == FEATURES
    assert caps.status("offload") == ("full" if T.SAC_INDEXED else "refused")
    assert caps.status("op outputs seen by the policy") == (
        "full" if T.SAC_OP_OUTPUT else "degraded")
    assert caps.status("chain segments") == "full"
    assert caps.status("CUDA peak meter") == ("full" if torch.cuda.is_available() else "degraded")
    text = str(caps)
    assert text.splitlines()[0] == f"memfit on torch {torch.__version__}, {caps.device}"
    assert all(f in text for f in FEATURES)
    with pytest.raises(KeyError, match="no feature 'jax'; the features are torch release"):
        caps.status("jax")


def test_a_refused_feature_raises_naming_the_release_that_has_it():
    if memfit.capabilities().status("offload") == "full":
        assert by_key({"aten.mm.default#0": memfit.OpPolicy.OFFLOAD}).host is not None
        return
    with pytest.raises(UnsupportedTorch, match="needs the indexed selective-checkpoint cache of "
                                               "torch 2.13 and newer"):
        by_key({"aten.mm.default#0": memfit.OpPolicy.OFFLOAD})


def test_doctor_prints_the_rows(capsys):
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out.strip() == str(memfit.capabilities())
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "memfit.Capabilities" and data["torch"] == torch.__version__
    assert [r["feature"] for r in data["rows"]] == FEATURES
    assert {r["status"] for r in data["rows"]} <= {"full", "degraded", "refused"}


def test_the_command_line_refuses_a_torch_outside_the_range_in_one_line(monkeypatch, capsys):
    """On a torch below the range even ``memfit --help`` built its parser through memfit's
    torch internals and died with a traceback; it says what is wrong in one line (exit 2)."""
    import memfit._torch

    monkeypatch.setattr(torch, "__version__", "2.8.0")
    monkeypatch.delitem(__import__("sys").modules, "memfit._torch")
    monkeypatch.delitem(__import__("sys").modules, "memfit.profiling.optimizer", raising=False)
    assert main(["--help"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memfit: error: memfit needs torch >=2.9,<2.16, but torch 2.8.0 is "
                          "installed") and err.count("\n") == 1
    assert memfit._torch  # the module imported before is untouched
