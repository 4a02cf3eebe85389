"""The memfit command line: each command's happy path, its --json, and its error exits.

Happy paths run ``python -m memfit`` in a subprocess (the real entry point); most error paths
call ``main(argv)`` in-process, which is the same code without the interpreter start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli.main import (
    EXIT_BAD_INPUT,
    EXIT_CODES,
    EXIT_INFEASIBLE,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_VERIFY_FAILED,
    exit_code_for,
    main,
)
from memfit.errors import (
    InfeasibleBudget,
    MemfitError,
    ModelError,
    PlanMismatch,
    ProfileMismatch,
    RecomputeMismatch,
    SchemaError,
    SolverTimeout,
    UnsupportedTorch,
    WrapError,
)

TINY = "gpt:n_layer=1,d_model=16,n_head=2,seq_len=8,vocab_size=32,batch=1"
SMALL = "gpt:n_layer=3,d_model=32,n_head=2,seq_len=32,vocab_size=64,batch=4"


def memfit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=180)


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# ---- help -----------------------------------------------------------------------------------
def test_root_help_documents_exit_codes(capsys):
    assert _main_code(["--help"]) == 0
    out = capsys.readouterr().out
    for line in ("0  success", "1  verification failed", "2  bad input", "3  no plan: an infeasible budget",
                 "4  internal error", "130  interrupted"):
        assert line in out
    for cmd in ("demo", "profile", "plan", "sweep", "verify"):
        assert cmd in out


@pytest.mark.parametrize("command", ["demo", "profile", "plan", "sweep", "verify"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: memfit {command}")
    assert "--json" in out


# ---- happy paths (mostly subprocess) ----------------------------------------------------------------
def test_profile_json(capsys):
    assert _main_code(["profile", TINY, "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "memfit.ProfileSummary" and data["mode"] == "measure"
    assert data["peak_bytes"] > 0 and data["ops"] > data["forward_ops"] > 0
    assert data["saved_by_module"][0]["module"] == "blocks.0"


@pytest.mark.processes
def test_plan_then_verify(tmp_path):
    plan_file = tmp_path / "plan.json"
    r = memfit("plan", SMALL, "--budget", "70%", "-o", str(plan_file), "--json")
    assert r.returncode == EXIT_OK, r.stderr
    data = json.loads(r.stdout)
    assert data["kind"] == "memfit.Plan" and data["plan_file"] == str(plan_file)
    assert data["predicted_peak_bytes"] <= data["budget_bytes"] == int(0.7 * data["plain_peak_bytes"])
    assert json.loads(plan_file.read_text())["regions"] == data["regions"]

    r = memfit("verify", SMALL, "--plan", str(plan_file))
    assert r.returncode == EXIT_OK, r.stdout + r.stderr
    assert "PASSED" in r.stdout and "[ok] parameter gradients" in r.stdout


@pytest.mark.processes
def test_sweep_writes_json_and_plot(tmp_path):
    out = tmp_path / "sw"
    r = memfit("sweep", TINY, "--budgets", "1.0,min", "--baselines", "every_block", "--repeats", "1",
               "--out", str(out), "--json")
    assert r.returncode == EXIT_OK, r.stderr
    data = json.loads(r.stdout)
    assert [row["label"] for row in data["rows"]] == ["plain", "100%", "min", "every_block"]
    assert json.loads((out / "sweep.json").read_text())["rows"] == data["rows"]
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.processes
def test_demo_on_a_small_model(tmp_path):
    r = memfit("demo", "--model", SMALL, "--out", str(tmp_path / "demo"), "--repeats", "1", "--no-progress")
    # 0 when every check passed, 1 when one failed: on a model this small the planner's peak
    # prediction can miss by more than verify's 3% (a planning matter, reported, not hidden)
    assert r.returncode in (EXIT_OK, EXIT_VERIFY_FAILED), r.stdout + r.stderr
    assert "| config" in r.stdout and "| every_block" in r.stdout and "it fits: peak" in r.stdout
    # the gradients of the verified plan are exact whatever the peak checks say
    assert "[ok] parameter gradients" in r.stdout and "[ok] loss: 1 tensor bitwise equal" in r.stdout
    for name in ("sweep.json", "sweep.png", "plan.json", "verify.json"):
        assert (tmp_path / "demo" / name).is_file(), name
    report = json.loads((tmp_path / "demo" / "verify.json").read_text())
    assert report["bitwise"] is True
    assert report["ok"] is (r.returncode == EXIT_OK)
    assert ("verification PASSED" in r.stdout) is report["ok"]


# ---- error paths ------------------------------------------------------------------------------
@pytest.mark.processes
def test_unknown_model_is_one_line_exit_2():
    r = memfit("plan", "gpt9000", "--budget", "50%")
    assert r.returncode == EXIT_BAD_INPUT
    line = one_line_error(r.stderr)
    assert line.startswith("memfit plan: error: unknown MODEL 'gpt9000'")
    assert r.stdout == ""


@pytest.mark.processes
def test_infeasible_budget_exit_3_names_smallest_feasible():
    r = memfit("plan", TINY, "--budget", "100")
    assert r.returncode == EXIT_INFEASIBLE
    line = one_line_error(r.stderr)
    assert "infeasible budget 100 B" in line and "smallest feasible peak is" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", TINY, "--budget", "lots"], "argument --budget: cannot parse budget 'lots'"),
        (["plan", TINY, "--budget", "150%"], "must lie in (0%, 100%], got '150%'"),
        (["plan", TINY], "give --budget (a cap on the activation peak) or --device-memory"),
        (["profile", "pkg_that_does_not_exist.mod:build"], "cannot import module 'pkg_that_does_not_exist.mod'"),
        (["profile", "memfit.zoo:gpt", "--input-shape", "2,a"], "cannot parse input shape '2,a'"),
        (["profile", "gpt:n_layers=2"], "zoo model 'gpt' has no option 'n_layers'"),
        (["verify", TINY, "--plan", "/no/such/plan.json"], "cannot read plan file /no/such/plan.json"),
        (["sweep", TINY, "--budgets", "1.0,abc"], "cannot parse budget 'abc'"),
        (["sweep", TINY, "--baselines", "nope"], "unknown baseline solver 'nope'"),
        (["plan", TINY, "--budget", "70%", "--lossy-codec", "fp8_e4m3"],
         "--lossy-codec fp8_e4m3 chooses the codec of --compress lossy; add --compress lossy"),
        (["plan", TINY, "--budget", "70%", "--compress", "lossy", "--tune"],
         "--compress lossy plans against --budget alone; not with --tune"),
        (["plan", TINY, "--device-memory", "1GiB", "--compress", "lossless"],
         "--compress lossless plans against --budget alone; not with --device-memory"),
        (["plan", TINY, "--budget", "70%", "--compress", "zip"], "argument --compress: invalid choice: 'zip'"),
    ],
    ids=["budget-word", "budget-over-100", "no-budget", "no-module", "bad-shape", "bad-option",
         "no-plan-file", "bad-budget-list", "bad-baseline", "lossy-codec-alone", "compress-tune",
         "compress-device-memory", "compress-word"],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    code = _main_code(argv)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert message in one_line_error(err)


def test_plan_file_that_is_not_a_plan(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    assert _main_code(["verify", TINY, "--plan", str(bad)]) == EXIT_BAD_INPUT
    assert "not valid JSON" in one_line_error(capsys.readouterr().err)
    bad.write_text('{"kind": "memfit.Profile"}')
    assert _main_code(["verify", TINY, "--plan", str(bad)]) == EXIT_BAD_INPUT
    assert "not a memfit plan" in one_line_error(capsys.readouterr().err)


@pytest.mark.processes
def test_plan_compress_lossy_below_the_least_exact_peak(tmp_path, capsys, monkeypatch):
    # Below the smallest recompute-only peak exact codecs still fit (two_level on the dropout
    # masks), and below the smallest of those fp8 does. Each floor is the one `plan` names for
    # a budget nothing fits (NOTE [the named compressed floor]: the same for every budget under
    # it, and it plans). One profile and the codecs' default costs for every `plan` call: this
    # test is of the planning, not of the timing. Before, each call profiled afresh and the test
    # lowered the lossless budget plan by plan: one byte under that floor the lossy search found
    # no plan twice in CI and in 2 of 30 runs alone (its options there followed the budget and
    # the measured op times).
    import memfit.cli.plan as cli_plan
    import memfit.measuring.codec_cost as codec_cost
    from memfit.planning.compression import DEFAULT_CODEC_COSTS

    monkeypatch.setattr(codec_cost, "codec_costs_for", lambda *a, **k: DEFAULT_CODEC_COSTS)
    profiled: dict[str, object] = {}
    profile_once = cli_plan.profile_model

    def same_profile(lm, target="cpu"):
        if "profile" not in profiled:
            profiled["profile"] = profile_once(lm, target)
        return profiled["profile"]

    monkeypatch.setattr(cli_plan, "profile_model", same_profile)

    def floor(*compress: str) -> int:
        assert _main_code(["plan", SMALL, "--budget", "1KiB", *compress, "--json"]) == EXIT_INFEASIBLE
        return json.loads(capsys.readouterr().out)["error"]["min_feasible_bytes"]

    least = floor()
    exact = floor("--compress", "lossless")
    lossy_floor = floor("--compress", "lossy", "--lossy-codec", "fp8_e4m3")
    assert lossy_floor < exact < least
    plan_file = tmp_path / "plan.json"
    argv = ["plan", SMALL, "--budget", str(lossy_floor), "--compress", "lossy", "--lossy-codec", "fp8_e4m3"]
    assert _main_code([*argv, "-o", str(plan_file), "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    lossy = [c for c in data["compressed"] if c["codec"] not in ("bool_bits", "two_level", "narrow_int", "sign_bit")]
    assert lossy and {c["codec"] for c in lossy} == {"fp8_e4m3"}
    assert data["predicted_peak_bytes"] <= data["budget_bytes"] == lossy_floor
    assert json.loads(plan_file.read_text())["compressed"] == data["compressed"]
    assert _main_code(argv) == EXIT_OK
    assert "LOSSY: gradients differ" in capsys.readouterr().out
    assert _main_code(["verify", SMALL, "--plan", str(plan_file), "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    # fp8_e4m3 keeps 4 significant bits: 2^-4 per element, stated bound 2^-3 on the gradients
    # (measured 0.030 on this model)
    assert report["ok"] and not report["bitwise"] and 0 < report["gradient_rel_error"] <= 2.0**-3


def test_plan_compress_lossless_stays_bitwise(capsys):
    assert _main_code(["plan", SMALL, "--budget", "80%", "--compress", "lossless", "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert all(c["codec"] in ("bool_bits", "two_level", "narrow_int", "sign_bit") for c in data["compressed"])
    assert data["predicted_peak_bytes"] <= data["budget_bytes"]


def test_verify_failure_exits_1(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    assert _main_code(["plan", SMALL, "--budget", "80%", "-o", str(plan_file)]) == EXIT_OK
    capsys.readouterr()
    # a budget far below any real peak: the verification must fail, and say why
    assert _main_code(["verify", SMALL, "--plan", str(plan_file), "--budget", "1KiB", "--json"]) == EXIT_VERIFY_FAILED
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["bitwise"] is True
    assert [c["name"] for c in data["checks"] if not c["passed"]] == ["peak within budget"]
    # the report is the one JSON object, with the error member every failed command prints
    assert data["error"] == {"type": "VerificationFailed", "exit_code": EXIT_VERIFY_FAILED,
                             "message": "1 check(s) failed: peak within budget"}


def test_verify_with_a_plan_for_another_model_is_bad_input(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    assert _main_code(["plan", TINY, "--budget", "min", "-o", str(plan_file)]) == EXIT_OK
    capsys.readouterr()
    two_layers = TINY.replace("n_layer=1", "n_layer=2")  # blocks.0 exists: the plan would apply
    bigger_batch = TINY.replace("batch=1", "batch=2")
    for other in (two_layers, bigger_batch):
        assert _main_code(["verify", other, "--plan", str(plan_file)]) == EXIT_BAD_INPUT
        line = one_line_error(capsys.readouterr().err)
        assert line.startswith("memfit verify: error: the plan is for another model: it was made "
                               "for GPT (profile signature ")
        assert "Plan this model with these input shapes" in line
    assert _main_code(["verify", TINY, "--plan", str(plan_file)]) == EXIT_OK  # its own model


# ---- values that start with a dash (NOTE [values that start with a dash]) -----------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["plan", TINY, "--budget", "-5%"], "argument --budget: a percentage budget is a share of the "
                                        "un-checkpointed peak and must lie in (0%, 100%], got '-5%'"),
    (["plan", TINY, "--budget", "-5GiB"], "argument --budget: "),
    (["profile", "memfit.zoo:gpt", "--input-shape", "-4,3"], "argument --input-shape: cannot parse input "
                                                             "shape '-4,3': part '-4' is not a positive integer"),
    (["profile", TINY, "--batch", "-2"], "argument --batch: expected a positive integer, got -2"),
    (["profile", TINY, "--seq-len", "-x"], "argument --seq-len: expected a positive integer, got '-x'"),
    (["profile", TINY, "--top", "-3"], "argument --top: expected a positive integer, got -3"),
    (["plan", TINY, "--budget", "50%", "--target", "-h100"], "argument --target: invalid choice: '-h100'"),
    (["sweep", TINY, "--budgets", "-10%,min"], "argument --budgets: a percentage budget"),
    (["plan", TINY, "--budget", "--json"], "argument --budget: expected one argument"),  # a missing value
], ids=["budget-percent", "budget-size", "shape", "batch", "seq-len", "top", "target", "budgets",
        "missing-value"])
def test_a_value_that_starts_with_a_dash_reaches_its_own_parser(argv, message, capsys):
    assert _main_code(argv) == EXIT_BAD_INPUT
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"memfit {argv[0]}: error: {message}"), line
    assert "expected one argument" not in line or argv[-1] == "--json"


def test_input_shapes_with_any_separator_parse_alike():
    from memfit.cli.main import build_parser

    shapes = [build_parser().parse_args(["profile", "pkg.mod:build", "--input-shape", s]).input_shape
              for s in ("4,3,32,32", "4x3x32x32", "4 3 32 32")]
    assert shapes == [[(4, 3, 32, 32)]] * 3


def test_a_bad_shape_part_is_named_with_exit_2(capsys):
    assert _main_code(["profile", "memfit.zoo:gpt", "--input-shape", "4,x,32,32"]) == EXIT_BAD_INPUT
    assert ("cannot parse input shape '4,x,32,32': part 'x' is not a positive integer"
            in one_line_error(capsys.readouterr().err))


# ---- every error as one JSON object under --json -------------------------------------------------
def test_json_usage_errors_print_one_error_object(capsys):
    assert _main_code(["plan", TINY, "--budget", "lots", "--json"]) == EXIT_BAD_INPUT
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["kind"] == "memfit.Error"
    assert data["error"]["type"] == "UsageError" and data["error"]["exit_code"] == EXIT_BAD_INPUT
    assert data["error"]["message"].startswith("argument --budget: cannot parse budget 'lots'")
    # the same message as the line on stderr, without the prefix and the pointer to --help
    assert one_line_error(out.err) == f"memfit plan: error: {data['error']['message']} (see memfit plan --help)"
    assert _main_code(["plan", "gpt9000", "--budget", "50%", "--json"]) == EXIT_BAD_INPUT
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["type"] == "ModelSpecError" and err["message"].startswith("unknown MODEL 'gpt9000'")


def test_json_infeasible_budget_names_the_smallest_feasible_peak(capsys):
    assert _main_code(["plan", TINY, "--budget", "100", "--json"]) == EXIT_INFEASIBLE
    out = capsys.readouterr()
    err = json.loads(out.out)["error"]
    assert err["type"] == "InfeasibleBudget" and err["exit_code"] == EXIT_INFEASIBLE
    assert err["budget_bytes"] == 100 and err["min_feasible_bytes"] > 100
    assert err["message"].startswith("infeasible budget 100 B: the smallest feasible peak is ")
    assert f"try --budget {err['min_feasible_bytes']} or --budget min" in one_line_error(out.err)


def test_plan_with_a_baseline_over_the_budget_writes_nothing_and_exits_3(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = _main_code(["plan", TINY, "--solver", "every_block", "--budget", "10%", "-o", str(out), "--json"])
    assert code == EXIT_INFEASIBLE and not out.exists()
    err = json.loads(capsys.readouterr().out)["error"]
    assert _main_code(["plan", TINY, "--solver", "every_block", "--budget", str(err["min_feasible_bytes"]),
                       "--json"]) == EXIT_OK  # the baseline's own peak: its plan fits
    p = json.loads(capsys.readouterr().out)
    assert p["solver"] == "every_block" and p["predicted_peak_bytes"] == err["min_feasible_bytes"]
    assert [r["modules"] for r in p["regions"]] == [["blocks.0"]]


def _raises(error):
    def run(args):
        raise error
    return run


ERRORS = {
    "RecomputeMismatch": (RecomputeMismatch("replay diverged"), EXIT_VERIFY_FAILED),
    "InfeasibleBudget": (InfeasibleBudget("x", budget_bytes=100, min_feasible_bytes=200), EXIT_INFEASIBLE),
    "SolverTimeout": (SolverTimeout("no plan in 1 s", solver="milp", time_limit_s=1.0), EXIT_INFEASIBLE),
    "ModelError": (ModelError("forward raised", model="m"), EXIT_BAD_INPUT),
    "PlanMismatch": (PlanMismatch("another model"), EXIT_BAD_INPUT),
    "ProfileMismatch": (ProfileMismatch("another model"), EXIT_BAD_INPUT),
    "WrapError": (WrapError("already wrapped"), EXIT_BAD_INPUT),
    "SchemaError": (SchemaError("corrupt"), EXIT_BAD_INPUT),
    "UnsupportedTorch": (UnsupportedTorch("no such API"), EXIT_BAD_INPUT),
    "ValueError": (ValueError("bad"), EXIT_BAD_INPUT),
    "FileNotFoundError": (FileNotFoundError("no file"), EXIT_BAD_INPUT),
    "MemfitError": (MemfitError("unclassified"), EXIT_INTERNAL),
    "KeyError": (KeyError("bug"), EXIT_INTERNAL),
}


@pytest.mark.parametrize(("error", "code"), ERRORS.values(), ids=ERRORS.keys())
def test_each_error_class_has_its_exit_code_and_json_object(error, code, monkeypatch, capsys):
    from memfit.cli import profile as profile_command

    monkeypatch.setattr(profile_command, "run", _raises(error))
    assert main(["profile", TINY, "--json"]) == code == exit_code_for(error)
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["kind"] == "memfit.Error"
    assert data["error"]["type"] == type(error).__name__ and data["error"]["exit_code"] == code
    assert one_line_error(out.err).startswith("memfit profile: ")
    assert main(["profile", TINY]) == code  # text mode: the line on stderr, nothing on stdout
    out = capsys.readouterr()
    assert out.out == "" and one_line_error(out.err).startswith("memfit profile: ")


def _sections(text: str, pattern: str) -> dict[int, str]:
    import re

    found = list(re.finditer(pattern, text, flags=re.M))
    return {int(m.group(1)): text[m.end(): found[i + 1].start() if i + 1 < len(found) else len(text)]
            for i, m in enumerate(found)}


def test_help_and_the_cli_docs_list_each_error_class_under_its_code():
    from memfit.cli.main import EPILOG
    from memfit.cli.models import UsageError

    docs = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    table = docs[docs.index("| code | meaning |"):].split("\n\n")[0]
    for doc in (_sections(EPILOG.split("\n\n")[0], r"^  (\d+)  "), _sections(table, r"^\| (\d+) \| ")):
        assert sorted(doc) == [0, 1, 2, 3, 4, 130]
        for cls, code in EXIT_CODES:
            name = "usage error" if cls is UsageError else cls.__name__
            assert name in doc[code], (name, code)
            assert all(name not in doc[c] for c in doc if c != code), name


def test_debug_shows_the_traceback(capsys):
    assert _main_code(["profile", "gpt:n_layers=2", "--debug"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("(plus batch= and size= for the example inputs)")


@pytest.mark.hf
def test_plan_hf_config_for_another_device(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=256)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    assert _main_code(["plan", str(path), "--budget", "75%", "--target", "h100", "--batch", "2", "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "memfit.Plan" and data["regions"]
    assert data["predicted_peak_bytes"] <= data["budget_bytes"]
    # no weights: verify refuses in one line
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({k: v for k, v in data.items() if k != "plan_file"}))
    assert _main_code(["verify", str(path), "--plan", str(plan_file)]) == EXIT_BAD_INPUT
    assert "meta device" in one_line_error(capsys.readouterr().err)


def _main_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors
        return int(e.code or 0)


@pytest.mark.processes
def test_plan_compress_under_the_chain_solvers_least_peak_compresses_its_least_peak_plan(capsys):
    # NOTE [compress or recompute]: one byte under the chain solver's least peak, none of the
    # looser budgets' fastest plans compresses to fit (their regions hold the compressible
    # tensors): the least-peak plan compressed outside its regions does (before: infeasible)
    base = ["plan", SMALL, "--solver", "chain"]
    assert _main_code([*base, "--budget", "min", "--json"]) == EXIT_OK
    least = json.loads(capsys.readouterr().out)["predicted_peak_bytes"]
    argv = [*base, "--budget", str(least - 1), "--compress", "lossy", "--json"]
    assert _main_code(argv) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["compressed"] and data["predicted_peak_bytes"] <= data["budget_bytes"] == least - 1


def test_plan_lossy_codec_none_takes_the_batch_norm_variants_alone(tmp_path, capsys):
    """``--lossy-codec none``: no codec on the other activations (bf16 would take them); the
    zoo ResNet's norms followed by a relu rebuilt from their outputs (NOTE [output-activated
    batch norm])."""
    import memfit.measuring.codec_cost as codec_cost
    from memfit.planning.compression import CODEC_SPECS, CodecCosts

    resnet = "resnet:width=8,batch=4"
    plan_file = tmp_path / "plan.json"
    argv = ["plan", resnet, "--budget", "85%", "--compress", "lossy", "--lossy-codec", "none", "--json"]
    # codecs free: the plain step with every candidate taken costs nothing and wins over any
    # recompute (whose seconds are this machine's measured ones); a test of what is taken
    free = CodecCosts({name: 0.0 for name in CODEC_SPECS}, 0.0, 0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec_cost, "codec_costs_for", lambda *a, **k: free)
        assert _main_code([*argv, "-o", str(plan_file)]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["predicted_peak_bytes"] <= data["budget_bytes"]
    codecs = {c["codec"] for c in data["compressed"]}
    assert codecs == {"bn_from_output"}, codecs
    assert _main_code(["verify", resnet, "--plan", str(plan_file), "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and not report["bitwise"] and 0 < report["gradient_rel_error"] <= 2.0**-10
