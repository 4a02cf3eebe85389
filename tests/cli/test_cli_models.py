"""MODEL resolution for the CLI: zoo names with options, module:factory, Hugging Face configs."""

from __future__ import annotations

import textwrap

import pytest
import torch

from memfit import zoo
from memfit.cli.models import UsageError, load_model, parse_dtype, parse_shape, split_options


@pytest.mark.parametrize(
    ("text", "shape"),
    [("2,3,32,32", (2, 3, 32, 32)), ("2x16", (2, 16)), (" 4 ", (4,)), ("4 3 32 32", (4, 3, 32, 32)),
     ("4x3x32x32", (4, 3, 32, 32)), ("4, 3, 32", (4, 3, 32)), ("4 X 3", (4, 3))],
    ids=["commas", "x", "one-size", "spaces", "x4", "commas-and-spaces", "capital-x"],
)
def test_parse_shape(text, shape):
    assert parse_shape(text) == shape


@pytest.mark.parametrize(("text", "part"), [
    ("4,x,32,32", "part 'x' is not a positive integer"),  # was read as (4, 32, 32)
    ("4 3,32", "part '4 3' is not a positive integer"),   # two separators
    ("2,-1", "part '-1' is not a positive integer"),
    ("4x0", "part '0' is not a positive integer"),
    ("2.5,3", "part '2.5' is not a positive integer"),
    ("4,,3", "an empty part"),
], ids=["x-as-a-size", "mixed", "negative", "zero", "float", "empty-part"])
def test_parse_shape_names_the_bad_part(text, part):
    with pytest.raises(UsageError) as e:
        parse_shape(text)
    assert str(e.value).startswith(f"cannot parse input shape {text!r}: {part}; ")


@pytest.mark.parametrize("text", ["", "2,a", "2,-1", "0"], ids=["empty", "letter", "negative", "zero"])
def test_parse_shape_rejects(text):
    with pytest.raises(UsageError, match="shape"):
        parse_shape(text)


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("torch.int64") is torch.int64
    with pytest.raises(UsageError, match="unknown dtype 'float8'"):
        parse_dtype("float8")


def test_split_options_keeps_brackets_and_types():
    assert split_options("n_layer=4,blocks_per_stage=(1,2),dropout=0.0,name=abc,flag=True") == {
        "n_layer": 4, "blocks_per_stage": (1, 2), "dropout": 0.0, "name": "abc", "flag": True,
    }
    with pytest.raises(UsageError, match="name=value"):
        split_options("n_layer")


def test_zoo_model_with_options_and_input_sizes():
    lm = load_model("gpt:n_layer=1,d_model=32,n_head=2,seq_len=16,vocab_size=50,batch=3,size=8")
    assert isinstance(lm.model, zoo.GPT)
    assert lm.model.cfg.n_layer == 1 and lm.model.cfg.d_model == 32
    assert tuple(lm.example_inputs.shape) == (3, 8)
    assert not lm.on_meta and lm.loss_fn is None
    # seeded: the same spec builds the same weights and inputs
    again = load_model("gpt:n_layer=1,d_model=32,n_head=2,seq_len=16,vocab_size=50,batch=3,size=8")
    assert torch.equal(lm.example_inputs, again.example_inputs)
    assert all(torch.equal(a, b) for a, b in zip(lm.model.parameters(), again.model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt2", "unknown MODEL 'gpt2'"),
        ("gpt:bogus=1", "has no option 'bogus'"),
        ("gpt:d_model=30,n_head=4", "divisible"),
        ("no_such_pkg_xyz.models:build", "cannot import module 'no_such_pkg_xyz.models'"),
        ("memfit.zoo:nothing_here", "has no callable 'nothing_here'"),
        ("missing.json", "there is no file missing.json"),
    ],
    ids=["unknown", "bad-option", "bad-value", "no-module", "no-attr", "no-json"],
)
def test_bad_models_raise_usage_error(spec, message):
    with pytest.raises(UsageError, match=message):
        load_model(spec)


def _write_factory(tmp_path, body: str):
    path = tmp_path / "user_models.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_factory_file_with_input_shape(tmp_path):
    path = _write_factory(tmp_path, """
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
        def with_inputs():
            return torch.nn.Linear(8, 4), torch.ones(5, 8)
    """)
    lm = load_model(f"{path}:build", input_shapes=[(2, 8)], dtype=torch.float64)
    assert isinstance(lm.model, torch.nn.Sequential)
    assert lm.example_inputs.shape == (2, 8) and lm.example_inputs.dtype is torch.float64
    assert lm.model.training
    lm2 = load_model(f"{path}:with_inputs")
    assert torch.equal(lm2.example_inputs, torch.ones(5, 8))
    with pytest.raises(UsageError, match="--input-shape"):
        load_model(f"{path}:build")
    two = load_model(f"{path}:build", input_shapes=[(2, 8), (3,)], dtype=torch.int64)
    assert [t.shape for t in two.example_inputs] == [(2, 8), (3,)]
    assert all(t.dtype is torch.int64 and not t.any() for t in two.example_inputs)


def test_factory_that_fails_is_one_line(tmp_path):
    path = _write_factory(tmp_path, """
        def build():
            raise RuntimeError("no GPU here")
        def wrong():
            return 42
    """)
    with pytest.raises(UsageError, match="build\\(\\) failed: RuntimeError: no GPU here"):
        load_model(f"{path}:build")
    with pytest.raises(UsageError, match="returned int"):
        load_model(f"{path}:wrong")


@pytest.mark.hf
def test_hf_config_builds_on_meta(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                   max_position_embeddings=64)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    lm = load_model(str(path), batch=2, seq_len=16)
    assert lm.on_meta
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert all(p.device.type == "meta" for p in lm.model.parameters())
    assert lm.example_inputs.shape == (2, 16) and lm.example_inputs.device.type == "meta"
    assert len(lm.model.model.layers) == 2
    assert lm.loss_fn is not None
    assert lm.loss_fn({"logits": torch.zeros(2, 16, 100, device="meta")}).shape == ()
    # a default context length, capped
    lm_default = load_model(str(path))
    assert lm_default.example_inputs.shape == (1, 64)


def test_causal_lm_loss_is_next_token_cross_entropy():
    from memfit.integrations.hf import causal_lm_loss

    ids = torch.tensor([[1, 2, 3]])
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 50.0  # predicts token 2 after token 1: right
    logits[0, 1, 0] = 50.0  # predicts token 0 after token 2: wrong (3 follows)
    loss = causal_lm_loss(ids)({"logits": logits})
    # position 0: ~0 loss; position 1: -log softmax(logits)[3] = 50 + log(1 + 3 e^-50) ~ 50
    expected = torch.nn.functional.cross_entropy(logits[0, :2], torch.tensor([2, 3]))
    assert torch.equal(loss, expected)
    assert 24.9 < float(loss) < 25.1  # mean of ~0 and ~50


def test_json_that_is_not_an_hf_config(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"kind": "memfit.Plan"}')
    with pytest.raises(UsageError, match="not a Hugging Face config"):
        load_model(str(path))
