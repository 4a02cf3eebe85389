"""Small Flax Linen models built in code, for tests and benchmarks of ``memfit.jax``.

``gpt(...)`` and ``conv3d(...)`` each return ``(loss_fn, params, batch, has_aux)``: what
``memfit.jax.profile`` and ``memfit.jax.fit`` take. Linen puts each module's path in the name
stack (``GPT/blocks_0/attn``), which memfit reads as scopes (NOTE [scopes] in
``memfit.jax.trace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["GPTConfig", "gpt", "conv3d"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    n_layer: int = 4
    d_model: int = 64
    n_head: int = 4
    seq_len: int = 64
    batch: int = 4


class _Attention(nn.Module):
    d_model: int
    n_head: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        hs = d // self.n_head
        qkv = nn.Dense(3 * d, name="qkv")(x)                            # (b, t, 3d)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, self.n_head, hs), 3, axis=2)
        q, k, v = (a[:, :, 0].transpose(0, 2, 1, 3) for a in (q, k, v))  # (b, h, t, hs)
        att = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(hs).astype(x.dtype)  # (b, h, t, t)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)             # (b, t, d)
        return nn.Dense(d, name="proj")(y)


class _Block(nn.Module):
    d_model: int
    n_head: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + _Attention(self.d_model, self.n_head, name="attn")(nn.LayerNorm(name="ln1")(x))
        h = nn.Dense(4 * self.d_model, name="fc")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(self.d_model, name="out")(jax.nn.gelu(h))


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, idx: jax.Array) -> jax.Array:
        c = self.cfg
        x = nn.Embed(c.vocab, c.d_model, name="wte")(idx)                  # (b, t, d)
        x = x + self.param("wpe", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
        for i in range(c.n_layer):
            x = _Block(c.d_model, c.n_head, name=f"blocks_{i}")(x)
        return nn.Dense(c.vocab, name="head")(nn.LayerNorm(name="ln_f")(x))  # (b, t, vocab)


def gpt(cfg: GPTConfig = GPTConfig(), seed: int = 0) -> tuple[Any, Any, Any, bool]:
    """A GPT-style decoder and a next-token loss: ``(loss_fn, params, batch, False)``."""
    model = GPT(cfg)
    k1, k2 = jax.random.split(jax.random.key(seed))
    idx = jax.random.randint(k1, (cfg.batch, cfg.seq_len), 0, cfg.vocab)
    tgt = jax.random.randint(k2, (cfg.batch, cfg.seq_len), 0, cfg.vocab)
    params = model.init(jax.random.key(seed + 1), idx)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        logits = model.apply(params, batch["idx"])
        logp = jax.nn.log_softmax(logits, axis=-1)  # type: ignore[arg-type]
        return -jnp.mean(jnp.take_along_axis(logp, batch["tgt"][..., None], axis=-1))

    return loss_fn, params, {"idx": idx, "tgt": tgt}, False


class _Stage(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for j in range(2):
            x = nn.Conv(self.features, (3, 3, 3), name=f"conv{j}")(x)
            x = nn.BatchNorm(use_running_average=False, momentum=0.9, name=f"bn{j}")(x)
            x = nn.relu(x)
        return x


class ConvNet3D(nn.Module):
    widths: tuple[int, ...] = (8, 16, 16)
    classes: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, w in enumerate(self.widths):
            x = _Stage(w, name=f"stage_{i}")(x)                          # (b, d, h, w, c)
        x = jnp.mean(x, axis=(1, 2, 3))
        return nn.Dense(self.classes, name="head")(x)


def conv3d(batch: int = 2, size: int = 16, widths: tuple[int, ...] = (8, 16, 16),
           seed: int = 0) -> tuple[Any, Any, Any, bool]:
    """A 3D conv net with BatchNorm (statistics as state): ``(loss_fn, params, batch, True)``;
    ``loss_fn`` returns ``(loss, new_batch_stats)``."""
    model = ConvNet3D(widths)
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (batch, size, size, size, 1))
    y = jax.random.randint(k2, (batch,), 0, model.classes)
    variables = model.init(jax.random.key(seed + 1), x)

    def loss_fn(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        logits, new = model.apply({"params": params, "batch_stats": batch["stats"]}, batch["x"],
                                  mutable=["batch_stats"])
        logp = jax.nn.log_softmax(logits)
        loss = -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=-1))
        return loss, new["batch_stats"]

    return loss_fn, variables["params"], {"x": x, "y": y, "stats": variables["batch_stats"]}, True
