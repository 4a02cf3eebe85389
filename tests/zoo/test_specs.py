"""memfit.zoo.specs: a model spec (zoo name, module:factory, Hugging Face config) as a Python API,
the same one the command line's MODEL argument goes through."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

import memfit
from memfit import zoo
from memfit.zoo.specs import LoadedModel, ModelSpecError, load_model


@pytest.mark.parametrize(
    ("spec", "kind", "shape"),
    [
        ("gpt:n_layer=1,d_model=32,n_head=2,seq_len=16,vocab_size=50,batch=3,size=8", zoo.GPT, (3, 8)),
        ("resnet:blocks_per_stage=(1,1),width=8,batch=2,size=16", zoo.ResNet, (2, 3, 16, 16)),
        ("memfit.zoo:gpt", zoo.GPT, None),  # a module:factory returning a bare module
    ],
    ids=["zoo-gpt", "zoo-resnet", "module-factory"],
)
def test_load_model_builds_a_trainable_model_and_its_inputs(spec, kind, shape):
    lm = load_model(spec, input_shapes=[(2, 16)] if shape is None else None, dtype=torch.int64)
    assert isinstance(lm, LoadedModel) and isinstance(lm.model, kind)
    assert lm.model.training and not lm.on_meta and lm.name == spec
    x = lm.example_inputs
    assert tuple(x.shape) == (shape or (2, 16))
    # the model runs a step on its inputs: a profile of it is a real one
    prof = memfit.profile(lm.model, x, loss_fn=lm.loss_fn, repeats=1)
    assert prof.peak_bytes > 0 and prof.n_forward > 0


def test_load_model_is_seeded():
    spec = "gpt:n_layer=1,d_model=32,n_head=2,seq_len=16,vocab_size=50,batch=2"
    a, b = load_model(spec), load_model(spec)
    assert torch.equal(a.example_inputs, b.example_inputs)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_factory_file_returning_module_and_inputs(tmp_path):
    path = tmp_path / "factories.py"
    path.write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Linear(8, 4), torch.ones(5, 8)
    """))
    lm = load_model(f"{path}:build")
    assert isinstance(lm.model, torch.nn.Linear) and torch.equal(lm.example_inputs, torch.ones(5, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lm.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("gpt2", {}, "unknown MODEL 'gpt2'"),
        ("gpt:bogus=1", {}, "has no option 'bogus'"),
        ("gpt", {"input_shapes": [(2, 8)]}, "input_shapes .* apply to module:factory models"),
        ("memfit.zoo:gpt", {}, "pass input_shapes="),
        ("  ", {}, "the model spec is empty"),
    ],
    ids=["unknown", "bad-option", "shapes-for-zoo", "bare-module-no-shapes", "empty"],
)
def test_a_bad_spec_raises_a_value_error_saying_what_to_do(spec, kwargs, message):
    with pytest.raises(ModelSpecError, match=message) as info:
        load_model(spec, **kwargs)
    assert isinstance(info.value, ValueError)


def test_the_command_line_loads_models_through_the_api():
    from memfit.cli import models as cli_models

    assert cli_models.load_model is load_model
    assert cli_models.UsageError is ModelSpecError  # the CLI maps it to exit code 2
