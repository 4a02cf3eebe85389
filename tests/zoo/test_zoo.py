import pytest
import torch

from memfit import zoo


@pytest.mark.parametrize(
    ("name", "options", "size", "out_shape"),
    [
        ("gpt", {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab_size": 50}, None, (2, 16, 50)),
        ("unet3d", {"base": 2, "depth": 2}, 8, (2, 2, 8, 8, 8)),
        ("resnet", {"blocks_per_stage": (1, 1), "width": 4}, 16, (2, 10)),
    ],
    ids=["gpt", "unet3d", "resnet"],
)
def test_zoo_builds_seeded_models(name, options, size, out_shape):
    a = zoo.build(name, **options)
    b = zoo.build(name, **options)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    x = zoo.example_inputs(a, batch=2, size=size)
    assert torch.equal(x, zoo.example_inputs(b, batch=2, size=size))
    a.eval()
    assert tuple(a(x).shape) == out_shape


def test_gpt_returns_loss_with_targets():
    m = zoo.gpt(n_layer=1, d_model=16, n_head=2, seq_len=8, vocab_size=20, dropout=0.0)
    x = zoo.example_inputs(m, batch=2)
    loss = m(x, x)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(m(x).view(16, 20), x.view(16)), rtol=0, atol=0)


def test_zoo_errors():
    with pytest.raises(ValueError, match="unknown zoo model 'vgg'"):
        zoo.build("vgg")
    with pytest.raises(ValueError, match="divisible"):
        zoo.gpt(d_model=30, n_head=4)
    with pytest.raises(TypeError, match="no example inputs"):
        zoo.example_inputs(torch.nn.Linear(2, 2))
    m = zoo.gpt(n_layer=1, d_model=16, n_head=2, seq_len=8)
    with pytest.raises(ValueError, match="longer than the model's seq_len 8"):
        m(torch.zeros(1, 9, dtype=torch.long))
