"""Test set-up: 8 fake CPU devices (set before jax is imported), a tiny config and loss inputs."""

import os
import re
import sys

os.environ.setdefault('JAX_NUM_CPU_DEVICES', '8')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Tests build the same small programs many times (a fresh jit per train state, and again in every
# subprocess a test starts); XLA's persistent cache compiles each once per suite run. Set in the
# environment before jax is imported, so the subprocesses share it: a fresh clone starts it cold.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.pytest_cache', 'xla'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.5')
# Most of the suite's time is XLA compiling small programs that then run for milliseconds: LLVM's
# optimisation passes cost more than they save here (decode_test and train_test, cold: 207 s ->
# 149 s). The golden tests give the same values either way; benchmarks, not tests, measure speed.
os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# PyTorch (the comparisons with transformers) runs one thread per core that spins while it waits:
# beside the other test worker's JAX it ran 2x slower than on one thread (hf_parity_test: 168 s
# against 79 s next to gguf_test).
os.environ.setdefault('OMP_NUM_THREADS', '1')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def small_config(num_mtp_heads: int = 2, steps: int = 8):
  """A config small enough that a jitted train step compiles in seconds on 2 cores."""
  from configs import base
  c = base.get_config()
  c.model.update(dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, max_seq_len=32))
  c.model.num_mtp_heads = num_mtp_heads
  c.distill.top_n = 8
  c.data.update(dict(seq_len=16, batch_size=8, synthetic_records=512))
  c.train.update(dict(steps=steps, lr=3e-3, log_every=2, eval_batches=1))
  c.ckpt.every_steps = 4
  c.mesh.shape = (1, 1, 1)  # one device: fast; the mesh tests build their own meshes
  return c


@pytest.fixture
def config():
  return small_config()


# Loss inputs shared by the loss, Top-N and fused-loss tests.


def distinct_logits(key, shape, scale=3.0):
  """Logits with distinct values in every row (a random permutation of a grid, plus noise)."""
  v = shape[-1]
  perm = jax.random.permutation(jax.random.key(key), v * 8)[:v].astype(jnp.float32)
  noise = jax.random.uniform(jax.random.key(key + 1), shape, minval=0.0, maxval=0.5)
  shuffle = jax.vmap(lambda k: jax.random.permutation(k, perm))(
      jax.random.split(jax.random.key(key + 2), int(np.prod(shape[:-1]))))
  return (shuffle.reshape(shape) + noise) * scale / v



def loss_inputs(k=3, b=2, t=10, v=40):
  logits = distinct_logits(9, (b, t, v), scale=6.0)
  mtp = jnp.stack([distinct_logits(10 + j, (b, t, v), scale=6.0) for j in range(k)])
  targets = jax.random.randint(jax.random.key(20), (b, t), 0, v)
  seg = jnp.ones((b, t), jnp.int32).at[1, 6:].set(2)  # two documents in row 1
  tseg = jnp.ones((b, t), jnp.int32).at[1, 5:].set(2)
  return logits, mtp, targets, seg, tseg



def gathered_shapes(hlo: str) -> list[list[int]]:
  """Shapes of every all-gather operand in compiled HLO text."""
  shapes = []
  for line in hlo.splitlines():
    if re.search(r'\ball-gather(-start)?\(', line):
      lhs = line.split('all-gather')[0]
      shapes += [[int(d) for d in dims.split(',') if d] for dims in re.findall(r'\w+\[([\d,]*)\]', lhs)]
  return shapes


@pytest.fixture
def few_candidates(monkeypatch):
  """The planner tries only plain, one head chain and one context chain: for tests of how a caller
  wires the planner in, where each further candidate only compiles two more programs (the planner's
  full candidate set is planner_test's)."""
  from mtpd_jax.harness import planner  # pylint: disable=import-outside-toplevel
  every = planner.candidates
  keep = lambda name: name in ('plain', 'chain1', 'context2')
  monkeypatch.setattr(planner, 'candidates',
                      lambda *a, **k: {n: o for n, o in every(*a, **k).items() if keep(n)})


def pytest_xdist_auto_num_workers(config):
  """`-n auto` (make test): one worker more than the cores. Many tests wait on subprocesses starting
  up, on checkpoint writes or on a signal: with one worker per core, a niced job beside a 2-core
  run of the suite still got about half a core."""
  del config
  return (os.cpu_count() or 1) + 1
