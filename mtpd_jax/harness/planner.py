"""The speculation planner (`eval.speculation='auto'`): the decoding setting with the most tokens
per second for this model, device and batch size, from two measurements (docs/design.md, "The
speculation planner").

1. Step cost: each candidate's decoding step, timed side by side with the plain step on the
   calibration prompts (`evaluate.step_seconds`), in plain steps. Cached per model shape, device,
   batch size and candidate in `<cache>/planner/`, since it depends on nothing else.
2. Acceptance: each candidate's tokens per forward, decoding the calibration prompts with it, greedy
   or sampled as the options say (the two accept differently).

A candidate's predicted speedup is its tokens per forward over its step cost; the planner picks
the largest, and plain decoding unless that beats plain by `margin`. Every candidate is lossless,
so the choice changes only the speed.
"""

import dataclasses
import hashlib
import json
import os
from typing import NamedTuple

import jax
import numpy as np

from mtpd_jax import decode, metrics, runtime
from mtpd_jax.drafting import DraftPlan
from mtpd_jax.harness import evaluate
from mtpd_jax.model import MTPTransformer

TREES = ((2, 1), (3, 1), (2, 2), (3, 2))  # the tree shapes tried beside the chains
ADAPTIVE_MIN_PROB = 0.5                  # adaptive depth tried on the deepest chain
CONTEXT_DEPTHS = (2, 4)                  # prompt-lookup chains tried (copies pay in runs)


class Choice(NamedTuple):
  name: str
  opts: decode.DecodeOptions
  predicted_speedup: float
  rows: dict  # per candidate: step_cost (plain steps), tokens_per_forward, predicted_speedup


def candidates(opts: decode.DecodeOptions, num_mtp_heads: int,
               max_depth: int = 0) -> dict[str, decode.DecodeOptions]:
  """Plain decoding, chains of depth 1..max_depth (default: K, or the configured depth if deeper),
  the trees of `TREES` that fit that depth, adaptive depth on the deepest chain, the context's
  chains of `CONTEXT_DEPTHS` and the deepest chain beside the context's, all drafting over the
  configured draft vocabulary, with the options' n-gram, temperature, top-p and stop tokens."""
  max_depth = max_depth or max(num_mtp_heads, opts.draft.depth)
  plan = lambda depth, tree=(), min_prob=0.0, source='heads': dataclasses.replace(
      opts, draft=DraftPlan(depth, tree, min_prob, opts.draft.vocab, source, opts.draft.ngram))
  out = {'plain': opts.plain()}
  out.update({f'chain{j}': plan(j) for j in range(1, max_depth + 1)})
  for tree in TREES:
    if len(tree) <= max_depth:
      out['tree' + 'x'.join(map(str, tree))] = plan(len(tree), tree)
  if max_depth >= 2:
    out[f'chain{max_depth}@{ADAPTIVE_MIN_PROB}'] = plan(max_depth, (), ADAPTIVE_MIN_PROB)
  out.update({f'context{j}': plan(j, source='context') for j in CONTEXT_DEPTHS})
  out[f'both{max_depth}'] = plan(max_depth, source='both')
  return out


def choose(step_cost: dict[str, float], tokens_per_forward: dict[str, float],
           margin: float) -> tuple[str, dict]:
  """The candidate with the largest predicted speedup (tokens per forward / step cost in plain
  steps), or 'plain' unless one beats it by more than `margin`; and every candidate's row."""
  rows = {}
  for name, cost in step_cost.items():
    tpf = tokens_per_forward[name]
    rows[name] = {'step_cost': cost, 'tokens_per_forward': tpf, 'predicted_speedup': tpf / cost}
  best = max(rows, key=lambda name: rows[name]['predicted_speedup'])
  return (best if rows[best]['predicted_speedup'] > 1.0 + margin else 'plain'), rows


def _cache_key(model: MTPTransformer, batch: int, pad_multiple: int,
               opts: decode.DecodeOptions) -> str:
  """What a step's cost depends on: the model's shapes, the device, the batch and the setting."""
  what = repr((model.cfg, jax.devices()[0].device_kind, jax.default_backend(), batch, pad_multiple,
               dataclasses.replace(opts, stop_tokens=()), 'v1'))
  return hashlib.sha256(what.encode()).hexdigest()[:16]


def step_costs(model: MTPTransformer, prompts, settings: dict[str, decode.DecodeOptions], *,
               pad_multiple: int, cache_dir: str | None, num_steps: int = 32,
               repeats: int = 3) -> dict[str, float]:
  """Each setting's step in plain steps (settings['plain'] = 1), measured side by side with the
  plain step, or read from `cache_dir` where this model shape, device and batch measured it."""
  keys = {name: _cache_key(model, len(prompts), pad_multiple, opts)
          for name, opts in settings.items()}
  path = lambda name: os.path.join(cache_dir, f'{keys[name]}.json')
  cost = {}
  for name in settings:
    if cache_dir and name != 'plain' and os.path.exists(path(name)):
      with open(path(name), encoding='utf-8') as f:
        cost[name] = float(json.load(f)['step_cost'])
  todo = {name: opts for name, opts in settings.items() if name not in cost and name != 'plain'}
  if todo:
    timed = {'plain': settings['plain'], **todo}
    seconds = evaluate.step_seconds(model, prompts, timed, pad_multiple=pad_multiple,
                                    num_steps=num_steps, repeats=repeats)
    for name in todo:
      cost[name] = seconds[name] / seconds['plain']
      if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        record = {'setting': name, 'step_cost': cost[name]}
        runtime.write_atomically(path(name), json.dumps(record))
  cost['plain'] = 1.0
  return cost


def acceptance(model: MTPTransformer, prompts, settings: dict[str, decode.DecodeOptions], *,
               pad_multiple: int, batch_size: int = 8) -> dict[str, float]:
  """Each setting's tokens per forward on the prompts, decoded `batch_size` at a time (plain: 1)."""
  structure, leaves = decode.split(model)
  out = {}
  for name, opts in settings.items():
    if not opts.draft.depth:
      out[name] = 1.0
      continue
    accepts = []
    for i in range(0, len(prompts), batch_size):
      gen = decode.generate_split(structure, leaves, prompts[i:i + batch_size], opts,
                                  pad_multiple=pad_multiple)
      accepts.extend(gen.accept_lengths)
    stats = metrics.acceptance_stats(np.concatenate(accepts), opts.draft.depth)
    out[name] = stats['tokens_per_forward']
  return out


def plan(model: MTPTransformer, prompts, opts: decode.DecodeOptions, *, batch_size: int,
         pad_multiple: int = 64, cache_dir: str | None = None, max_depth: int = 0,
         max_new_tokens: int = 48, margin: float = 0.03,
         tokens_per_forward: dict[str, float] | None = None, log=print) -> Choice:
  """The fastest setting for decoding `batch_size` prompts at a time with `opts`' sampling, stop
  tokens and draft vocabulary. `prompts` are the calibration prompts (keep them apart from the
  prompts measured afterwards): all of them give the acceptance, the first `batch_size` the step
  costs. `tokens_per_forward`: an earlier plan's `rows` acceptance, reused for another batch size
  (acceptance does not depend on it). Printed as a table with the predicted speedups."""
  if not prompts:
    raise ValueError('the speculation planner needs at least one calibration prompt')
  settings = candidates(opts, model.cfg.num_mtp_heads, max_depth)
  short = {name: dataclasses.replace(o, max_new_tokens=min(max_new_tokens, o.max_new_tokens))
           for name, o in settings.items()}
  batch = [prompts[i % len(prompts)] for i in range(batch_size)]
  cost = step_costs(model, batch, settings, pad_multiple=pad_multiple, cache_dir=cache_dir)
  tpf = tokens_per_forward or acceptance(model, prompts, short, pad_multiple=pad_multiple)
  name, rows = choose(cost, tpf, margin)
  log(f'speculation planner (batch {batch_size}, {len(prompts)} calibration prompts, '
      f"{'greedy' if not opts.temperature else f'temperature {opts.temperature:g}'}):")
  log(f"  {'setting':<14} {'step cost':>10} {'tokens/fwd':>11} {'predicted':>10}")
  for n, r in sorted(rows.items(), key=lambda kv: -kv[1]['predicted_speedup']):
    chosen = '  <- chosen' if n == name else ''
    log(f"  {n:<14} {r['step_cost']:>9.2f}x {r['tokens_per_forward']:>11.2f} "
        f"{r['predicted_speedup']:>9.2f}x{chosen}")
  return Choice(name, settings[name], rows[name]['predicted_speedup'], rows)


def measure(model: MTPTransformer, prompts, choice: Choice, *, batch_size: int,
            pad_multiple: int = 64, repeats: int = 3, log=print) -> dict:
  """The chosen setting's tokens/s over plain decoding's on `prompts`, timed side by side
  (`evaluate.timed_decode`), beside its predicted speedup; printed in one line."""
  settings = {'plain': choice.opts.plain(), 'auto': choice.opts}
  runs = evaluate.timed_decode(model, prompts, settings, batch_size=batch_size,
                               pad_multiple=pad_multiple, repeats=repeats)
  (plain, plain_s), (auto, auto_s) = runs['plain'], runs['auto']
  tps = lambda gen, s: sum(map(len, gen.tokens)) / s
  out = {'setting': choice.name, 'predicted_speedup': choice.predicted_speedup,
         'speedup_measured': tps(auto, auto_s) / tps(plain, plain_s),
         'lossless': all(np.array_equal(a, b) for a, b in zip(plain.tokens, auto.tokens))}
  if choice.opts.draft.depth:
    stats = metrics.acceptance_stats(np.concatenate(auto.accept_lengths), choice.opts.draft.depth)
    out['tokens_per_forward'] = stats['tokens_per_forward']
  log(f"auto ({choice.name}): predicted {out['predicted_speedup']:.2f}x, "
      f"measured {out['speedup_measured']:.2f}x plain's tokens/s "
      f"(batch {batch_size}, {len(prompts)} prompts)")
  return out
