from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from profiling_models import TinyGPT, gpt_inputs, mlp

from memfit.errors import ProfileMismatch, SchemaError
from memfit.profiling.profile import Profile
from memfit.profiling.tracer import check_profile_matches, trace
from memfit.timemodel.calibration import Calibration, CalibrationSource, TimedPlan, TimeTerms


@pytest.fixture(scope="module")
def gpt_profile() -> Profile:
    return trace(TinyGPT(), gpt_inputs(), loss_fn=lambda out: out, repeats=1)


def test_round_trip_equality(gpt_profile: Profile, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    gpt_profile.save(path)
    back = Profile.load(path)
    assert back == gpt_profile
    assert back.extra == json.loads(json.dumps(gpt_profile.extra))


def test_corrupt_file_raises(gpt_profile: Profile, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(SchemaError, match="not valid JSON"):
        Profile.load(path)
    data = gpt_profile.to_dict()
    del data["ops"][0]["name"]
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match="corrupt"):
        Profile.load(path)


def test_other_schema_version_raises(gpt_profile: Profile, tmp_path: Path) -> None:
    data = gpt_profile.to_dict()
    data["schema_version"] = 999
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match="999"):
        Profile.load(path)


def test_profile_matches_its_model(gpt_profile: Profile) -> None:
    check_profile_matches(gpt_profile, TinyGPT(), gpt_inputs(), loss_fn=lambda out: out)


@pytest.mark.parametrize("other", ["deeper", "mlp"])
def test_profile_of_another_model_raises(gpt_profile: Profile, other: str) -> None:
    if other == "deeper":
        model, x = TinyGPT(n_layer=3), gpt_inputs()
        kw = {"loss_fn": lambda out: out}
    else:
        model, x, kw = mlp(), torch.randn(2, 64), {}
    with pytest.raises(ProfileMismatch, match="forward op"):
        check_profile_matches(gpt_profile, model, x, **kw)


# ---- the time model in a Profile's JSON --------------------------------------------------
def _blocks(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
                                 for _ in range(n)))


FITTED = Calibration(matmul_scale=1.5, other_scale=2.25, region_s=2.0**-11, op_s=2.0**-17,
                     selective_op_s=2.0**-15, source=CalibrationSource.FIT,
                     fitted=("matmul_scale", "other_scale"),
                     measurements=(TimedPlan("every_block", TimeTerms(0.5, 0.25, 2, 8, 0), 0.75, 1.5),))


@pytest.mark.parametrize("cal", [None, Calibration.default("fake mode"), FITTED], ids=["none", "default", "fitted"])
def test_profile_json_round_trip_keeps_the_calibration(tmp_path, cal: Calibration | None) -> None:
    import dataclasses

    prof = dataclasses.replace(trace(_blocks(2), torch.randn(4, 32), repeats=1), calibration=cal)
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof
    assert back.calibration == cal
    if cal is not None:
        assert back.calibration.measurements == cal.measurements  # not part of ==


def test_profile_json_without_calibration_still_loads(tmp_path) -> None:
    """A profile written before calibration existed has no ``calibration`` key."""
    import dataclasses

    prof = dataclasses.replace(trace(_blocks(2), torch.randn(4, 32), repeats=1), calibration=FITTED)
    data = prof.to_dict()
    del data["calibration"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    back = Profile.load(tmp_path / "old.json")
    assert back.calibration is None
    assert back == dataclasses.replace(prof, calibration=None)
