"""Evaluate self-speculative decoding over prompt sets (AR/CAR, speedups, losslessness) and write reports.

Timing: every batch shape is compiled before the clock starts; plain and speculative greedy
decoding of the same prompts run one after the other in this process. The measured speedup is
the ratio of their wall-clock tokens/s; the analytic one is tokens per main forward divided by
the measured cost of one speculative step (draft + verify) relative to one plain decoding step.
"""

import dataclasses
import functools
import hashlib
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtpd_jax import decode, losses, metrics, runtime
from mtpd_jax.model import ModelConfig, MTPTransformer
from mtpd_jax.shifts import shift_left


def frequent_tokens(tokens, size: int) -> np.ndarray:
  """The `size` most frequent ids of a 1-D token array, ascending: a draft vocabulary ranked by
  frequency in the training text, as FR-Spec restricts EAGLE's drafts (ties: the smaller id)."""
  counts = np.bincount(np.asarray(tokens).ravel())
  if size < 1:
    raise ValueError(f'a draft vocabulary needs size >= 1, got {size}')
  return np.sort(np.argsort(-counts, kind='stable')[:size]).astype(np.int32)


def _batches(prompts, batch_size: int):
  """Length-sorted batches of (indices, prompts); a short last batch repeats a prompt to keep the shape."""
  order = np.argsort([len(p) for p in prompts], kind='stable')
  for i in range(0, len(order), batch_size):
    idx = order[i:i + batch_size]
    yield idx, [prompts[k] for k in idx] + [prompts[idx[0]]] * (batch_size - len(idx))


def timed_decode(model: MTPTransformer, prompts, settings: dict[str, decode.DecodeOptions], *, batch_size: int = 8,
                 pad_multiple: int = 64, repeats: int = 3, compiled: set | None = None,
                 rounds: dict | None = None) -> dict[str, tuple[decode.Generation, float]]:
  """Decode all prompts under each named setting: outputs and wall-clock seconds.

  Batch by batch, the settings take turns, so a change in machine load hits them alike. A setting
  runs a batch shape (padded prompt length) it has not run before once untimed, to compile; the
  time is the sum over batches of each batch's best of `repeats`, which filters out interruptions
  by other processes. `compiled` holds the (setting, shape) pairs already compiled; pass one set to
  calls that decode the same model under the same settings, so that only the first compiles.
  `rounds`, if given, receives per setting the seconds of each of the `repeats` rounds (summed
  over batches): their spread is the timing's noise.
  """
  structure, leaves = decode.split(model)
  compiled = set() if compiled is None else compiled
  out = {name: [None] * len(prompts) for name in settings}
  seconds = dict.fromkeys(settings, 0.0)
  per_round = {name: [0.0] * max(repeats, 1) for name in settings}
  for idx, batch in _batches(prompts, batch_size):
    shape = decode.pad_prompts(batch, pad_multiple)[0].shape
    for name, opts in settings.items():
      if (name, shape) not in compiled:
        decode.generate_split(structure, leaves, batch, opts, pad_multiple=pad_multiple)
        compiled.add((name, shape))
    best = dict.fromkeys(settings, math.inf)
    for r in range(max(repeats, 1)):
      for name, opts in settings.items():
        start = time.perf_counter()
        gen = decode.generate_split(structure, leaves, batch, opts, pad_multiple=pad_multiple)
        took = time.perf_counter() - start
        best[name] = min(best[name], took)
        per_round[name][r] += took
        for row, k in enumerate(idx):
          out[name][k] = gen.tokens[row], gen.accept_lengths[row]
    for name in settings:
      seconds[name] += best[name]
  if rounds is not None:
    rounds.update(per_round)
  return {name: (decode.Generation(*map(list, zip(*out[name]))), seconds[name]) for name in settings}


def step_seconds(model: MTPTransformer, prompts, settings: dict[str, decode.DecodeOptions], *,
                 pad_multiple: int = 64, num_steps: int = 256, repeats: int = 5,
                 out_major: dict | None = None) -> dict[str, float]:
  """Wall-clock seconds of one decoding step on this batch of prompts, per named setting.

  Times jitted loops of 8 and 8 + num_steps steps (compiled first, best of `repeats`, settings
  alternating) and divides the difference by num_steps, so dispatch and argument handling cancel.
  `out_major` maps a setting's name to the matrix layout it decodes with (`decode.split`; default:
  split's own).
  """
  layouts = {name: (out_major or {}).get(name) for name in settings}
  splits = {om: decode.split(model, om) for om in set(layouts.values())}
  prompt_BxT, lens_B = decode.pad_prompts(prompts, pad_multiple)
  states = {name: decode.jit_prefill(*splits[layouts[name]], prompt_BxT, lens_B, jax.random.key(0), opts)
            for name, opts in settings.items()}
  best = {}
  for r in range(max(repeats, 1) + 1):
    for name, opts in settings.items():
      for n in (8, 8 + num_steps) if r else (8,):  # round 0 compiles (one program for any count)
        start = time.perf_counter()
        jax.block_until_ready(decode.jit_steps(*splits[layouts[name]], states[name], opts, n, False))
        if r:
          best[name, n] = min(best.get((name, n), math.inf), time.perf_counter() - start)
  return {name: max(best[name, 8 + num_steps] - best[name, 8], 1e-9) / num_steps for name in settings}


@functools.partial(jax.jit, static_argnames=('structure', 'draft_depth'))
def _teacher_forced_batch(structure: decode.Structure, leaves, tokens_BxT, scored_BxT, draft_depth: int):
  """Argmax ids of the main head (BxT) and of each draft depth (JxBxT), and the main head's summed
  cross-entropy, correct predictions and count of the next tokens where `scored_BxT`."""
  logits_BxTxV, draft_logits_JxBxTxV = decode.looped_forward_split(structure, leaves, tokens_BxT, draft_depth)
  sums = _next_token_sums(logits_BxTxV, shift_left(tokens_BxT, 1), scored_BxT)
  return (jnp.argmax(logits_BxTxV, axis=-1), jnp.argmax(draft_logits_JxBxTxV, axis=-1), *sums)


def teacher_forced(model: MTPTransformer, prompts, continuations, draft_depth: int, batch_size: int = 8) -> dict:
  """Teacher-forced AR/CAR on prompt + continuation, over chains that lie inside the continuation,
  and the main head's next-token loss and accuracy on the prompts (`main_loss`, `main_accuracy`:
  as `heldout_metrics` counts them, from the same forward pass).

  Runs `batch_size` sequences at a time and keeps only the argmax ids: the logits of a whole
  prompt set at once (B x T x V, times 1 + J) is gigabytes on a real vocabulary.
  """
  seqs = [np.concatenate([p, c]) for p, c in zip(prompts, continuations)]
  tokens_BxT, _ = decode.pad_prompts(seqs, 64)
  valid_BxT, scored_BxT = np.zeros(tokens_BxT.shape, bool), np.zeros(tokens_BxT.shape, bool)
  for b, (p, c) in enumerate(zip(prompts, continuations)):
    valid_BxT[b, len(p) - 1:len(p) + len(c)] = True  # main logits there predict continuation tokens
    scored_BxT[b, :len(p) - 1] = True  # and these the prompt's own
  n = len(seqs)
  pad = lambda x_BxT: np.concatenate([x_BxT, np.zeros((-n % batch_size, x_BxT.shape[1]), x_BxT.dtype)])
  padded_BxT, scored_padded_BxT = pad(tokens_BxT), pad(scored_BxT)
  structure, leaves = decode.split(model, out_major=False)
  main, drafts, totals = [], [], np.zeros(3)
  for i in range(0, len(padded_BxT), batch_size):  # one shape, one compilation
    main_ids, draft_ids, xent, correct, count = _teacher_forced_batch(
        structure, leaves, padded_BxT[i:i + batch_size], scored_padded_BxT[i:i + batch_size],
        draft_depth)
    main.append(np.asarray(main_ids))
    drafts.append(np.asarray(draft_ids))
    totals += [float(xent), float(correct), float(count)]
  main_BxT, draft_JxBxT = np.concatenate(main)[:n], np.concatenate(drafts, axis=1)[:, :n]
  stats = metrics.teacher_forced_stats(main_BxT, draft_JxBxT, valid_BxT)
  loss, correct = (totals[:2] / totals[2]) if totals[2] else (math.nan, math.nan)  # 1-token prompts: none
  return {**stats, 'main_loss': float(loss), 'main_accuracy': float(correct)}


def trunk_signature(cfg: ModelConfig) -> str:
  """What plain decoding's cost depends on: the model's shape without its MTP heads. A report
  divides two rows' speedups only where their trunks match (docs/design.md, "Metrics")."""
  fields = dataclasses.replace(cfg, num_mtp_heads=0)
  return hashlib.sha256(repr(fields).encode()).hexdigest()[:12]


def _round_speedups(rounds: dict, runs: dict) -> list[float]:
  """The speedup each timing round measured (plain's seconds over speculative's, times the token
  ratio), so a report can tell a difference from the timing's noise (docs/design.md, "Metrics")."""
  tokens = {name: sum(map(len, gen.tokens)) for name, (gen, _) in runs.items()}
  return [(tokens['spec'] / spec_s) / (tokens['plain'] / plain_s)
          for plain_s, spec_s in zip(rounds['plain'], rounds['spec'])]


def evaluate_prompt_set(model: MTPTransformer, prompts, opts: decode.DecodeOptions, *, batch_size: int = 8,
                        pad_multiple: int = 64, repeats: int = 3, timing_steps: int = 256, timing_repeats: int = 5,
                        latency_prompts: int = 0, compiled: set | None = None) -> dict:
  """Speculative decoding as `opts` says against plain decoding (`opts.plain()`) of one prompt set:
  acceptance, speedups, losslessness.

  With adaptive depth (`DraftPlan.min_prob`) `ar`/`car` count a draft that was not proposed as not
  accepted, so they describe the decoder, not the heads (`tf_ar` does); with a tree, `ar`/`car`
  and `accept_len` are those of the path each step kept. `latency_prompts` > 0 also times both
  decodings one prompt at a time (batch 1, the latency case) on that many of the prompts:
  `speedup_batch1`. `compiled`: as in `timed_decode`.
  """
  plan = opts.draft
  settings = {'plain': opts.plain(), 'spec': opts}
  rounds, rounds1 = {}, {}
  runs = timed_decode(model, prompts, settings, batch_size=batch_size, pad_multiple=pad_multiple, repeats=repeats,
                      compiled=compiled, rounds=rounds)
  (plain, plain_s), (spec, spec_s) = runs['plain'], runs['spec']
  stats = metrics.acceptance_stats(np.concatenate(spec.accept_lengths), plan.depth)
  plain_tokens, spec_tokens = sum(map(len, plain.tokens)), sum(map(len, spec.tokens))
  costs = step_seconds(model, next(_batches(prompts, batch_size))[1], settings, pad_multiple=pad_multiple,
                       num_steps=timing_steps, repeats=timing_repeats)
  plain_step, spec_step = costs['plain'], costs['spec']
  tf = teacher_forced(model, prompts, plain.tokens, plan.depth, batch_size)
  plain_tps, spec_tps = plain_tokens / plain_s, spec_tokens / spec_s
  latency = {}
  if latency_prompts:
    one = timed_decode(model, prompts[:latency_prompts], settings, batch_size=1, pad_multiple=pad_multiple,
                       repeats=repeats, compiled=compiled, rounds=rounds1)
    tps = {name: sum(map(len, gen.tokens)) / s for name, (gen, s) in one.items()}
    latency = {'latency_prompts': min(latency_prompts, len(prompts)),
               'plain_tokens_per_s_batch1': tps['plain'], 'spec_tokens_per_s_batch1': tps['spec'],
               'speedup_batch1': tps['spec'] / tps['plain'],
               'speedup_batch1_rounds': _round_speedups(rounds1, one)}
  return {
      **stats,
      'draft_depth': plan.depth,
      'draft_vocab': len(plan.vocab),
      'draft_min_prob': plan.min_prob, 'tree': list(plan.tree), 'draft_source': plan.source,
      'lossless': all(np.array_equal(a, b) for a, b in zip(plain.tokens, spec.tokens)),
      'prompts': len(prompts), 'new_tokens': spec_tokens,
      'plain_tokens_per_s': plain_tps, 'spec_tokens_per_s': spec_tps,
      'speedup_measured': spec_tps / plain_tps,
      'speedup_rounds': _round_speedups(rounds, runs),
      'plain_step_ms': 1e3 * plain_step, 'spec_step_ms': 1e3 * spec_step,
      'verify_cost_ratio': spec_step / plain_step,
      'speedup_analytic': stats['tokens_per_forward'] / (spec_step / plain_step),
      'tf_ar': tf['ar'], 'tf_car': tf['car'],
      # The main head's own quality on the prompts (Table 2's left half).
      'main_accuracy': tf['main_accuracy'], 'main_loss': tf['main_loss'],
      # Per prompt, in prompt order: what a paired comparison of two models resamples (report.py).
      'per_prompt': metrics.per_prompt_counts(spec.accept_lengths),
      **latency,
  }


def evaluate_prompt_sets(model: MTPTransformer, prompt_sets: dict[str, list[np.ndarray]], opts: decode.DecodeOptions,
                         **kwargs) -> dict:
  """`evaluate_prompt_set` for each named set (keyword arguments as there); shapes compile once."""
  compiled = set()
  return {name: evaluate_prompt_set(model, prompts, opts, compiled=compiled, **kwargs)
          for name, prompts in prompt_sets.items()}


@functools.partial(jax.jit, static_argnames=('structure',))
def _heldout_sums(structure: decode.Structure, leaves, batch):
  """Summed main-head cross-entropy, correct argmax predictions and counted targets of one batch."""
  logits_BxTxV = structure.merge(leaves)(batch['inputs'], batch.get('segment_ids')).logits_BxTxV
  if 'target_segment_ids' in batch:  # targets that start a new document are not predictable
    mask_BxT = losses.target_mask(batch['segment_ids'], batch['target_segment_ids'], 0)
  else:
    mask_BxT = jnp.ones(batch['targets'].shape, bool)
  return _next_token_sums(logits_BxTxV, batch['targets'], mask_BxT)


def _next_token_sums(logits_BxTxV, targets_BxT, mask_BxT):
  """Summed cross-entropy, correct argmax predictions and counted targets where `mask_BxT`."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  xent_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)
  correct_BxT = jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT
  return jnp.sum(xent_BxT * mask_BxT), jnp.sum(correct_BxT * mask_BxT), jnp.sum(mask_BxT)


def heldout_metrics(model: MTPTransformer, batches) -> dict:
  """Main head's next-token cross-entropy and argmax accuracy over held-out token batches.

  A batch is a dict of BxT id arrays as mtpd_jax.data makes them: `inputs`, `targets` (the next
  tokens) and optionally `segment_ids` with `target_segment_ids`, which leave out targets that
  start a new document.
  """
  structure, leaves = decode.split(model, out_major=False)  # long rows: the training layout is faster
  totals = np.zeros(3)
  for batch in batches:
    keys = ('inputs', 'targets', 'segment_ids', 'target_segment_ids')
    batch = {k: jnp.asarray(batch[k], jnp.int32) for k in keys if k in batch}
    totals += np.array([float(x) for x in _heldout_sums(structure, leaves, batch)])
  loss, correct, count = totals
  return {'loss': loss / count, 'accuracy': correct / count, 'tokens': int(count)}


def json_ready(x):
  """nan -> None (strict JSON), numpy scalars -> Python."""
  if isinstance(x, dict):
    return {k: json_ready(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_ready(v) for v in x]
  if isinstance(x, (float, np.floating)):
    return None if math.isnan(x) else float(x)
  return x.item() if isinstance(x, np.generic) else x


def _pct(x: float) -> str:
  return '–' if math.isnan(x) else f'{100 * x:.2f}'


def markdown_table(results: dict) -> str:
  """The paper's Table 1/7 layout: rows = heads (draft depths), columns = prompt sets, cells CAR / AR %."""
  names = list(results)
  depth = max(len(r['ar']) for r in results.values())
  lines = ['| H | ' + ' | '.join(names) + ' |', '|---|' + '---|' * len(names)]
  for k in range(depth):
    cells = [f"{_pct(r['car'][k])} / {_pct(r['ar'][k])}" if k < len(r['ar']) else ''
             for r in results.values()]
    lines.append(f'| {k + 1} | ' + ' | '.join(cells) + ' |')
  for label, key, fmt in (('accepted drafts / step', 'accept_len', '{:.3f}'),
                          ('tokens / main forward', 'tokens_per_forward', '{:.3f}'),
                          ('speedup, measured', 'speedup_measured', '{:.3f}x'),
                          ('speedup, analytic', 'speedup_analytic', '{:.3f}x'),
                          ('lossless (= plain greedy)', 'lossless', '{}')):
    lines.append(f'| {label} | ' + ' | '.join(fmt.format(r[key]) for r in results.values()) + ' |')
  return '\n'.join(lines) + '\n'


def write_report(results: dict, workdir: str, heldout: dict | None = None) -> None:
  """eval.json (everything), eval.md (Table 1/7 layout) and eval.png (AR and CAR vs head) in `workdir`.

  With no prompt-set results (a model without heads) only the held-out line is written, no plot.
  """
  os.makedirs(workdir, exist_ok=True)
  runtime.write_atomically(os.path.join(workdir, 'eval.json'),
                           json.dumps(json_ready({'prompt_sets': results, 'heldout': heldout}), indent=2))
  md = ['# Speculative decoding with the MTP heads', '']
  if results:
    md += ['Cells: CAR / AR (%) of draft depth H (head ((H-1) mod K)+1), greedy verification.', '',
           markdown_table(results)]
  if heldout:
    md.append(f"Main head, held-out: loss {heldout['loss']:.4f}, next-token accuracy "
              f"{100 * heldout['accuracy']:.2f}% over {heldout['tokens']} tokens.\n")
  runtime.write_atomically(os.path.join(workdir, 'eval.md'), '\n'.join(md))
  if results:
    _plot(results, os.path.join(workdir, 'eval.png'))


def _plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  depth = max(len(r['ar']) for r in results.values())
  for ax, key, title in zip(axes, ('ar', 'car'), ('AR (conditional)', 'CAR (cumulative)')):
    for name, r in results.items():
      ax.plot(range(1, len(r[key]) + 1), [100 * x for x in r[key]], marker='o', label=name)
    ax.set(title=title, xlabel='head (draft depth)', ylabel='%', ylim=(0, 100), xticks=range(1, depth + 1))
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
