"""Tokens/s of self-speculative vs plain KV-cache greedy decoding of one briefly trained tiny model.

  python -m benchmarks.decode_speed [--train_steps=300] [--depths=4,8] [--batch_size=1]

A tiny model (8 layers, width 64) with K=4 heads is first trained for a few hundred steps on the
learnable synthetic stream of mtpd_jax.data (arithmetic progressions mod V-1, EOS between
documents) with CE losses on the main head and every MTP head, so that the heads accept; a random
model would accept ~0. Prompts are the openings of held-out records. Depth 4 uses each head once,
depth 8 loops them (training-free, SPEC §4.2). Prints name=value lines and writes
benchmarks/results/decode_speed.json.
"""

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtpd_jax import data, evaluate
from mtpd_jax.model import ModelConfig, MTPTransformer

# An 8-layer trunk, so that a head (one block) costs about 1/8 of a trunk forward, as in real MTP models.
TINY = ModelConfig(vocab_size=64, dim=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=192, num_mtp_heads=4, max_seq_len=512)


def synthetic_tokens(vocab_size: int, seq_len: int, records: range, seed: int = 0) -> np.ndarray:
  """Rows of seq_len+1 tokens: records of the synthetic stream, each starting a document."""
  src = data.SyntheticSource(vocab_size, seq_len, max(records) + 1, seed=seed)
  return np.stack([np.append(r['inputs'], r['targets'][-1]) for r in map(src.__getitem__, records)])


def _xent(logits_BxTxV, targets_BxT):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT))


def train_tiny(cfg: ModelConfig = TINY, *, steps: int = 300, batch_size: int = 16, seq_len: int = 64,
               lr: float = 3e-3, seed: int = 0) -> MTPTransformer:
  """A model trained with CE on the main head and on every head k (position i -> token i+k+1)."""
  model = MTPTransformer(cfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(lr)

  @jax.jit
  def train_step(params, opt_state, tokens_BxT1):
    def loss_fn(params):
      out = nnx.merge(graphdef, params)(tokens_BxT1[:, :-1])
      targets_BxT, t = tokens_BxT1[:, 1:], tokens_BxT1.shape[1] - 1
      loss = _xent(out.logits_BxTxV, targets_BxT)
      for k in range(1, cfg.num_mtp_heads + 1):  # head k at i predicts token i+k+1 = targets[i+k]
        loss += _xent(out.mtp_logits_KxBxTxV[k - 1][:, :t - k], targets_BxT[:, k:])
      return loss
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  tokens = synthetic_tokens(cfg.vocab_size, seq_len, range(steps * batch_size), seed)
  for i in range(steps):
    params, opt_state, _ = train_step(params, opt_state, tokens[i * batch_size:(i + 1) * batch_size])
  nnx.update(model, params)
  return model


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--train_steps', type=int, default=300, help='Adam steps on the synthetic stream')
  p.add_argument('--depths', default='4,8', help='draft depths to benchmark (> K loops the heads)')
  p.add_argument('--num_layers', type=int, default=TINY.num_layers, help='trunk layers (a head: 1 block)')
  p.add_argument('--num_prompts', type=int, default=8, help='held-out prompts')
  p.add_argument('--prompt_len', type=int, default=12, help='tokens per prompt')
  p.add_argument('--batch_size', type=int, default=1, help='prompts decoded together')
  p.add_argument('--max_new_tokens', type=int, default=128, help='new tokens per prompt')
  p.add_argument('--repeats', type=int, default=3, help='timed passes (the best counts)')
  p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results', 'decode_speed.json'))
  return p.parse_args(argv)


def main(args: argparse.Namespace) -> dict:
  cfg = dataclasses.replace(TINY, num_layers=args.num_layers)
  start = time.perf_counter()
  model = train_tiny(cfg, steps=args.train_steps)
  train_s = time.perf_counter() - start
  rows = synthetic_tokens(cfg.vocab_size, args.prompt_len, range(args.num_prompts), seed=1_000_003)
  prompts = list(rows[:, :args.prompt_len])
  results = {**{k: v for k, v in vars(args).items() if k != 'out'}, 'train_s': train_s,
             'device': str(jax.devices()[0]), 'model': cfg.__dict__, 'depths': {}}
  for depth in map(int, args.depths.split(',')):
    r = evaluate.evaluate_prompt_set(model, prompts, draft_depth=depth, max_new_tokens=args.max_new_tokens,
                                     batch_size=args.batch_size, pad_multiple=16, repeats=args.repeats)
    r['speedup_measured_over_analytic'] = r['speedup_measured'] / r['speedup_analytic']
    if args.batch_size == 1:  # where the time goes: per step of the timed runs, prefill and calls included
      plain_s, spec_s = (r['new_tokens'] / r[f'{m}_tokens_per_s'] for m in ('plain', 'spec'))
      r['plain_wall_ms_per_step'] = 1e3 * plain_s / (r['new_tokens'] - len(prompts))  # prefill emits one
      r['spec_wall_ms_per_step'] = 1e3 * spec_s / r['steps']
    results['depths'][depth] = r
    for key in ('tokens_per_forward', 'accept_len', 'plain_tokens_per_s', 'spec_tokens_per_s',
                'plain_step_ms', 'spec_step_ms', 'plain_wall_ms_per_step', 'spec_wall_ms_per_step',
                'verify_cost_ratio', 'speedup_measured', 'speedup_analytic',
                'speedup_measured_over_analytic'):
      if key in r:
        print(f'depth{depth}/{key}={r[key]:.4g}')
    print(f"depth{depth}/lossless={r['lossless']}")
    print(f"depth{depth}/car=" + ','.join(f'{x:.3f}' for x in r['car']))
    print(f"depth{depth}/ar=" + ','.join(f'{x:.3f}' for x in r['ar']))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(evaluate.json_ready(results), f, indent=2)
  print(f'wrote {args.out}')
  return results


if __name__ == '__main__':
  main(parse_args())
