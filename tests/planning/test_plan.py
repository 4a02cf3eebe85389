import json

import pytest

from memfit import OpPolicy, Plan, Region, SchemaError


def _plan() -> Plan:
    return Plan(
        regions=(
            Region.saving(("blocks.0",), ("aten.mm.default#0", "aten.addmm.default#1"), recompute_s=0.01, saved_bytes=4096),
            Region(("blocks.1", "blocks.2"), recompute_s=0.02, saved_bytes=1024),
        ),
        predicted_peak_bytes=123_456,
        recompute_s=0.03,
        budget_bytes=130_000,
        solver="chain",
        profile_signature="abcdef0123456789",
        plain_peak_bytes=200_000,
        plain_step_s=0.3,
        model="GPT",
        notes=("picked chain: a chain of 3 blocks holds 90% of saved bytes",),
        extra={"module_types": {"blocks.0": "Block"}},
    )


def test_plan_json_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.extra == plan.extra
    assert loaded.regions[1].is_segment and loaded.regions[1].name == "blocks.1..blocks.2"


def test_plan_str_is_a_table():
    text = str(_plan())
    assert "chain" in text and "blocks.1..blocks.2" in text and "+10.0% step time" in text
    assert "120.56 KiB of 195.31 KiB (62%)" in text


def test_plan_str_says_which_kept_ops_are_draws():
    """A SAVE on a dropout draw keeps the mask (NOTE [kept draws]); the table says so."""
    assert "dropout draw" not in str(_plan())
    region = Region.saving(("blocks.0",), ("aten.bernoulli_.float#0", "aten.bernoulli_.float#2",
                                           "aten.addmm.default#0"))
    plan = Plan((region,), 100, 0.01, None, "milp", "")
    assert "kept ops include 2 dropout draw(s)" in str(plan)


def test_plan_overhead_and_fraction():
    plan = _plan()
    assert plan.overhead == pytest.approx(0.1, rel=1e-12)
    assert plan.peak_fraction == 123_456 / 200_000


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not valid JSON"),
        ('{"kind": "other"}', "not a memfit plan"),
        ('{"kind": "memfit.Plan", "schema_version": 99}', "schema version 99"),
        ('{"kind": "memfit.Plan", "schema_version": 1, "regions": []}', "corrupt memfit plan"),
    ],
    ids=["garbage", "wrong-kind", "future-version", "missing-fields"],
)
def test_plan_load_errors(tmp_path, text, match):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(SchemaError, match=match):
        Plan.load(path)


def test_plan_load_missing_file(tmp_path):
    with pytest.raises(SchemaError, match="cannot read plan file"):
        Plan.load(tmp_path / "nope.json")


def test_region_needs_a_module():
    with pytest.raises(ValueError, match="at least one module"):
        Region(())


def test_plan_json_is_plain_data():
    data = json.loads(json.dumps(_plan().to_dict()))
    assert data["regions"][0]["ops"] == {"aten.mm.default#0": "save", "aten.addmm.default#1": "save"}


def test_version_1_plan_reads_as_save_decisions(tmp_path):
    """A plan written before per-op decisions (NOTE [plan schema]) reads as the same plan."""
    data = _plan().to_dict()
    data["schema_version"] = 1
    for r in data["regions"]:
        r["save"] = [k for k, v in r.pop("ops").items() if v == "save"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    assert Plan.load(path) == _plan()


def test_unknown_decision_is_refused(tmp_path):
    data = _plan().to_dict()
    data["regions"][0]["ops"]["aten.mm.default#0"] = "swap"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=r"unknown op decision\(s\) \['swap'\]"):
        Plan.load(path)


def test_region_ops_take_decisions_not_bare_keys():
    r = Region(("b",), {"aten.mm.default#0": OpPolicy.SAVE, "aten.gelu.default#0": OpPolicy.RECOMPUTE})
    assert r.ops == (("aten.mm.default#0", OpPolicy.SAVE),)   # RECOMPUTE is the default: not listed
    assert r.save == ("aten.mm.default#0",) and r == Region.saving(("b",), ["aten.mm.default#0"])
    with pytest.raises(TypeError, match="Region.saving"):
        Region(("b",), ("aten.mm.default#0",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a memfit.OpPolicy"):
        Region(("b",), {"aten.mm.default#0": "save"})  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "name"), [
    ({"predicted_peak_bytes": -5}, "predicted_peak_bytes is -5"),
    ({"budget_bytes": -1}, "budget_bytes is -1"),
    ({"recompute_s": -0.5}, "recompute_s is -0.5"),
], ids=["peak", "budget", "seconds"])
def test_plan_load_refuses_negative_quantities(tmp_path, field, name):
    data = {**_plan().to_dict(), **field}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=f"corrupt memfit plan: {name}, and bytes, seconds and "
                                          "FLOPs are never negative"):
        Plan.load(path)


def test_plan_load_refuses_a_negative_region():
    data = _plan().to_dict()
    data["regions"][1]["saved_bytes"] = -1024
    with pytest.raises(SchemaError, match="region blocks.1..blocks.2's saved_bytes is -1024"):
        Plan.from_dict(data)
