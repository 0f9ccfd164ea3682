"""The briefly trained models the decoding benchmarks and tests decode with: a tiny MTP model on the
synthetic stream, and heads trained on a frozen trunk (`train_mtp` with `trainable=HEADS`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtpd_jax import data
from mtpd_jax.model import ModelConfig, MTPTransformer

# An 8-layer trunk, so that a head (one block) costs about 1/8 of a trunk forward, as in real MTP models.
TINY = ModelConfig(vocab_size=64, dim=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=192, num_mtp_heads=4, max_seq_len=512)
HEADS = nnx.All(nnx.Param, nnx.PathContains('mtp_heads'))  # the MTP heads' parameters: the trunk stays frozen

def token_rows(src, records) -> np.ndarray:
  """Records of a token source as rows of seq_len+1 tokens."""
  return np.stack([np.append(r['inputs'], r['targets'][-1]) for r in map(src.__getitem__, records)])


def synthetic_tokens(vocab_size: int, seq_len: int, records: range, seed: int = 0) -> np.ndarray:
  """Rows of seq_len+1 tokens: records of the synthetic stream, each starting a document."""
  return token_rows(data.SyntheticSource(vocab_size, seq_len, max(records) + 1, seed=seed), records)


def _xent(logits_BxTxV, targets_BxT):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT))


def mtp_xent(model: MTPTransformer, tokens_BxT1, *, main_head: bool = True):
  """(loss, xent_K): the main head's CE (if `main_head`) plus each head k's, summed; xent_K per head."""
  out = model(tokens_BxT1[:, :-1])
  targets_BxT, t = tokens_BxT1[:, 1:], tokens_BxT1.shape[1] - 1
  loss, xents = _xent(out.logits_BxTxV, targets_BxT) if main_head else 0.0, []
  for k in range(1, model.cfg.num_mtp_heads + 1):  # head k at i predicts token i+k+1 = targets[i+k]
    xents.append(_xent(out.mtp_logits_KxBxTxV[k - 1][:, :t - k], targets_BxT[:, k:]))
    loss += xents[-1]
  return loss, jnp.stack(xents) if xents else jnp.zeros((0,))


def train_mtp(model: MTPTransformer, rows_BxT1, *, steps: int, batch_size: int, lr: float,
              trainable=nnx.Param, main_head: bool = True) -> np.ndarray:
  """Adam on the `trainable` parameters (all, or HEADS) against `mtp_xent`, in place; returns xent_SxK.

  Step i reads rows i*batch_size... of `rows_BxT1` (cycling). Parameters outside `trainable`
  enter the step as constants, so a frozen trunk gets no gradient and no optimizer state.
  """
  graphdef, params, frozen = nnx.split(model, trainable, ...)
  tx = optax.adam(lr)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, frozen, tokens_BxT1):
    loss_fn = lambda p: mtp_xent(nnx.merge(graphdef, p, frozen), tokens_BxT1, main_head=main_head)
    (_, xent_K), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, xent_K

  opt_state, xents = tx.init(params), []
  for i in range(steps):
    batch = rows_BxT1[np.arange(i * batch_size, (i + 1) * batch_size) % len(rows_BxT1)]
    params, opt_state, xent_K = train_step(params, opt_state, frozen, batch)
    xents.append(xent_K)
  nnx.update(model, params)
  return np.asarray(jax.device_get(xents)).reshape(steps, model.cfg.num_mtp_heads)


def train_tiny(cfg: ModelConfig = TINY, *, steps: int = 300, batch_size: int = 16, seq_len: int = 64,
               lr: float = 3e-3, seed: int = 0) -> MTPTransformer:
  """A model trained with CE on the main head and on every head k (position i -> token i+k+1)."""
  model = MTPTransformer(cfg, rngs=nnx.Rngs(seed))
  rows = synthetic_tokens(cfg.vocab_size, seq_len, range(steps * batch_size), seed)
  train_mtp(model, rows, steps=steps, batch_size=batch_size, lr=lr)
  return model
