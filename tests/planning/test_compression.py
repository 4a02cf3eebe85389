"""memfit.planning.compression: the one codec registry (NOTE [adding a codec]), read without torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memfit.planning.compression import (
    CODEC_SPECS,
    DEFAULT_CODEC_COSTS,
    LOSSLESS_CODECS,
    LOSSY_CODECS,
    Compressed,
    Exactness,
    codec_packed_bytes,
    codec_spec,
)

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "memfit"
REGISTRY = PACKAGE / "planning" / "compression.py"

# "bf16" is also bfloat16's short name: these modules read it as a dtype, never as the codec
DTYPE_ALIASES = {("bf16", "profiling/optimizer.py"), ("bf16", "job/device_memory.py"),
                 ("bf16", "zoo/specs.py"), ("bf16", "integrations/deepspeed.py")}


def _names_spelled(path: Path, names: set[str]) -> list[tuple[str, int]]:
    """The string constants in ``path`` that are a codec's whole name, with their lines."""
    return [(node.value, node.lineno) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_codec_names_are_spelled_only_in_the_registry() -> None:
    names = set(CODEC_SPECS)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path == REGISTRY:
            continue
        found += [f"{rel}:{line}: {name!r}" for name, line in _names_spelled(path, names)
                  if (name, rel) not in DTYPE_ALIASES]
    assert not found, ("codec names outside memfit/planning/compression.py (refer to the "
                       "registry's CodecSpec.name instead):\n" + "\n".join(found))


def test_the_registry_spells_each_name_once() -> None:
    spelled = [name for name, _ in _names_spelled(REGISTRY, set(CODEC_SPECS))]
    assert sorted(spelled) == sorted(CODEC_SPECS)


def test_the_scan_sees_a_name_spelled_elsewhere(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('"""two_level in prose is fine."""\nCODEC = "two_level"\nOTHER = "two_levels"\n')
    assert _names_spelled(probe, set(CODEC_SPECS)) == [("two_level", 2)]


# (name, exactness, packed bytes of 1000 fp32 elements, of 1 element): counted by hand
SPECS = [
    ("bool_bits", Exactness.EXACT, 125, 1),
    ("two_level", Exactness.EXACT, 125 + 4, 1 + 4),
    ("narrow_int", Exactness.EXACT, 4000, 4),
    ("sign_bit", Exactness.SIGN, 125, 1),
    ("shape_only", Exactness.SHAPE, 0, 0),
    ("inplace_abn", Exactness.REBUILT, 0, 0),
    ("bn_from_output", Exactness.REBUILT, 0, 0),
    ("bf16", Exactness.LOSSY, 2000, 2),
    ("fp8_e4m3", Exactness.LOSSY, 1000 + 4, 1 + 4),
    ("int8_blockwise", Exactness.LOSSY, 1000 + 4 * 4, 1 + 4),
]


@pytest.mark.parametrize(("name", "exactness", "packed_1000", "packed_1"), SPECS, ids=[s[0] for s in SPECS])
def test_each_codec_facts(name: str, exactness: Exactness, packed_1000: int, packed_1: int) -> None:
    spec = codec_spec(name)
    assert spec.name == name and spec.exactness is exactness
    assert codec_packed_bytes(name, 1000, 4) == packed_1000
    assert codec_packed_bytes(name, 1, 4) == packed_1
    # shape_only does no work per byte (it keeps no bytes): its cost is the per-tensor one
    assert DEFAULT_CODEC_COSTS.per_byte_s[name] == spec.per_byte_s
    assert spec.per_byte_s > 0 or exactness is Exactness.SHAPE
    assert spec.keeps


def test_the_lists_follow_the_registry() -> None:
    assert [s[0] for s in SPECS] == list(CODEC_SPECS)
    assert LOSSLESS_CODECS == ("bool_bits", "two_level", "narrow_int", "sign_bit", "shape_only")
    assert LOSSY_CODECS == ("bf16", "fp8_e4m3", "int8_blockwise")
    assert set(DEFAULT_CODEC_COSTS.per_byte_s) == set(CODEC_SPECS)


@pytest.mark.parametrize("call", [
    pytest.param(lambda: codec_spec("zip"), id="codec_spec"),
    pytest.param(lambda: codec_packed_bytes("zip", 10, 4), id="codec_packed_bytes"),
    pytest.param(lambda: Compressed("aten.relu.default#0", "zip"), id="Compressed"),
])
def test_an_unknown_codec_lists_the_registry(call) -> None:
    listed = str(sorted(CODEC_SPECS)).replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=f"unknown codec 'zip'; memfit knows {listed}"):
        call()


def test_codec_costs_on_another_device_from_the_passes() -> None:
    from memfit.planning.compression import CODEC_SPECS, codec_costs_on

    c = codec_costs_on(900e9, 5e-6)
    assert c.per_byte_s == {n: s.passes / 900e9 for n, s in CODEC_SPECS.items()}
    assert c.per_byte_s["shape_only"] == 0.0 and c.per_byte_s["sign_bit"] == 5.5 / 900e9
    # the most launches of any codec (two_level, int8_blockwise: 12) at 5 us each
    assert c.per_tensor_s == pytest.approx(12 * 5e-6, rel=1e-12)
    assert c.mode_per_op_s == DEFAULT_CODEC_COSTS.mode_per_op_s


def test_a_fake_gpu_profile_is_priced_for_its_preset_not_this_machine() -> None:
    import torch
    from torch import nn

    import memfit
    from memfit.measuring.codec_cost import codec_costs_for
    from memfit.planning.compression import codec_costs_on
    from memfit.timemodel.devices import preset

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    prof = memfit.profile(model, torch.empty(4, 8, device="meta"), mode="fake", target="v100")
    v100 = preset("v100")
    assert codec_costs_for("lossless", profile=prof) == codec_costs_on(v100.bandwidth_bytes_per_s, v100.op_overhead_s)
