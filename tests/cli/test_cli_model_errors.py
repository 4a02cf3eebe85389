"""A user's model that raises, or has nothing to differentiate, is bad input (exit 2, one line
naming MODEL and the model's error); a fault inside memfit stays an internal error (exit 4)."""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest

from memfit.cli.main import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, main
from memfit.profiling.modules import ModuleRecorder, param_owners

USER_MODELS = """
    import dataclasses

    import torch
    from torch import nn


    def shape_mismatch():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 4), nn.Linear(5, 2)), torch.randn(2, 8)


    class Doubler(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2


    def no_parameters():
        return Doubler(), torch.randn(2, 8)


    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        steps: int = 0


    class WithDataclassOutput(nn.Module):
        def __init__(self, as_dataclass):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(8, 4)
            self.as_dataclass = as_dataclass

        def forward(self, x):
            y = torch.tanh(self.lin(x))
            return Out(y) if self.as_dataclass else y


    def dataclass_output():
        return WithDataclassOutput(True), torch.ones(2, 8)


    def tensor_output():
        return WithDataclassOutput(False), torch.ones(2, 8)
"""


@pytest.fixture()
def user_models(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(textwrap.dedent(USER_MODELS))
    return path


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors
        return int(e.code or 0)


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    ("factory", "command", "words"),
    [
        ("shape_mismatch", ["profile"],
         # torch 2.15 prefixes the op ("addmm: mat1 and mat2 ...")
         ["Sequential's forward raised RuntimeError: ", "mat1 and mat2 shapes cannot be multiplied "
          "(2x4 and 5x2)", "not of memfit"]),
        ("shape_mismatch", ["plan", "--budget", "60%"],
         ["Sequential's forward raised RuntimeError: ", "mat1 and mat2 shapes"]),
        ("shape_mismatch", ["profile", "--target", "h100"],  # fake mode, on the meta device
         ["Sequential's forward raised RuntimeError: ", "[2, 4] X [5, 2]"]),
        ("no_parameters", ["profile"],
         ["nothing in Doubler's training step requires grad", "Doubler has no trainable parameter",
          "no backward pass and nothing to checkpoint", "requires_grad=True"]),
    ],
    ids=["shape-mismatch-profile", "shape-mismatch-plan", "shape-mismatch-fake", "no-parameters"],
)
def test_user_model_error_exits_2_naming_the_model(user_models, factory, command, words, capfd):
    # capfd, not capsys: torch's own log handlers write to the stderr file descriptor
    spec = f"{user_models}:{factory}"
    code = _run([command[0], spec, *command[1:]])
    line = _one_line(capfd.readouterr().err)
    assert code == EXIT_BAD_INPUT, line
    assert line.startswith(f"memfit {command[0]}: error: model {spec}: ")
    for w in words:
        assert w in line


def test_a_fault_in_memfit_stays_an_internal_error(user_models, monkeypatch, capsys):
    # memfit's module hook breaks (an AttributeError raised in memfit's own code while the
    # user's forward runs): that is memfit's bug, not the model's
    monkeypatch.setattr(ModuleRecorder, "_sids", lambda self, obj: param_owners(obj))
    with warnings.catch_warnings():  # torch warns that the broken always_call hook was silenced
        warnings.filterwarnings("ignore", message="module forward hook with ``always_call=True``")
        code = _run(["profile", f"{user_models}:tensor_output"])
    line = _one_line(capsys.readouterr().err)
    assert code == EXIT_INTERNAL, line
    assert line.startswith("memfit profile: internal error: AttributeError:")
    assert "rerun with --debug" in line


def test_dataclass_output_profiles_like_a_tensor_output(user_models, capsys):
    assert _run(["profile", f"{user_models}:dataclass_output", "--json"]) == EXIT_OK
    got = json.loads(capsys.readouterr().out)
    assert _run(["profile", f"{user_models}:tensor_output", "--json"]) == EXIT_OK
    want = json.loads(capsys.readouterr().out)
    for key in ("ops", "forward_ops", "peak_bytes", "baseline_bytes", "saved_bytes", "signature"):
        assert got[key] == want[key], key
