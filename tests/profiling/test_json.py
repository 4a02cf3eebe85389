from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TinyGPT, gpt_inputs, mlp

from memfit.errors import ProfileMismatch, SchemaError
from memfit.profiling.profile import Profile
from memfit.profiling.tracer import check_profile_matches, profile


@pytest.fixture(scope="module")
def gpt_profile() -> Profile:
    return profile(TinyGPT(), gpt_inputs(), loss_fn=lambda out: out, repeats=1)


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
