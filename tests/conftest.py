"""Test set-up: 8 fake CPU devices (set before jax is imported) and a tiny config."""

import os
import sys

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402

# Tests build the same small programs many times (a fresh jit per train state); XLA's persistent
# cache compiles each once per machine.
jax.config.update('jax_compilation_cache_dir',
                  os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '.pytest_cache', 'xla'))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def small_config(num_heads: int = 2, steps: int = 8):
  """A config small enough that a jitted train step compiles in seconds on 2 cores."""
  from configs import base
  c = base.get_config()
  c.model.update(dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, max_seq_len=32))
  c.mtp.num_heads = num_heads
  c.distill.top_n = 8
  c.data.update(dict(seq_len=16, batch_size=8, synthetic_records=512))
  c.train.update(dict(steps=steps, lr=3e-3, log_every=2, eval_batches=1))
  c.ckpt.every_steps = 4
  c.mesh.shape = (1, 1, 1)  # one device: fast; the mesh tests build their own meshes
  return c


@pytest.fixture
def config():
  return small_config()
