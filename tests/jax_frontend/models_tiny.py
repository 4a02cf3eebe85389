"""The tiny models the memfit.jax tests share (each traced once per test module)."""

from memfit.jax.models import GPTConfig, conv3d, gpt


def tiny_gpt():
    return gpt(GPTConfig(vocab=64, n_layer=4, d_model=16, n_head=2, seq_len=16, batch=2))


def tiny_conv3d():
    return conv3d(batch=2, size=8, widths=(4, 8, 8))


MODELS = {"gpt": tiny_gpt, "conv3d": tiny_conv3d}
