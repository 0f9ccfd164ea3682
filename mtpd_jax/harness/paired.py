"""Paired differences between a sweep's rows: the same prompts decoded by both, seed s against seed s.

AR1 and tokens per forward get a two-level bootstrap interval (seeds, then prompts within each);
what is measured once per seed (the main head's accuracy) gets a t-interval over the seeds. The
report (report.py) prints them; docs/design.md ("Metrics") says why they pair.
"""

import numpy as np


def set_mean(ev: dict, fn):
  """The mean of fn(prompt set's results) over an evaluation's prompt sets (None where none has it)."""
  vals = [v for v in map(fn, ev['prompt_sets'].values()) if v is not None]
  return float(np.mean(vals)) if vals else None


BOOTSTRAP_SAMPLES = 4000


def evals_by_seed(runs) -> dict[int, dict]:
  """{seed: eval} of a row's evaluated runs. A run's seed is its 'seed' (the sweep's seed index,
  set by `experiment.write_sweep_report`); a run without one (a one-seed row) counts by position."""
  return {int(r.get('seed', i)): r['eval'] for i, r in enumerate(runs) if r.get('eval')}


def _prompt_counts(ev: dict, name: str):
  """Per-prompt (steps, accepted_1, accepted) of prompt set `name`, a [P, 3] array (None without)."""
  pp = ev['prompt_sets'].get(name, {}).get('per_prompt')
  return None if pp is None else np.array([pp['steps'], pp['accepted_1'], pp['accepted']], float).T


def paired_bootstrap(a, b, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict:
  """AR1 and tokens per forward of `a` minus `b` on the same P prompts, for S paired seeds.

  a, b: [P, 3] (one seed) or [S, P, 3] arrays of per-prompt (steps, accepted_1, accepted); seed
  s of `a` is paired with seed s of `b` (the same data order and initial shift). `diff` is the
  difference of the pooled rates; `lo`/`hi` the 2.5 and 97.5 percentiles of it over a two-level
  resample, the same for both rows: S seeds drawn with replacement, then P prompts with
  replacement within each, so the interval holds the seed-to-seed spread as well as the prompts'.
  `verdict` says whether the interval lies above zero, below it, or holds it ('inconclusive').
  A resample that draws only prompts without a decoding step (a prompt that ends at once) has no
  rate and is left out of the percentiles; with no steps at all, every figure is nan.
  """
  a_SeedsxPromptsx3, b_SeedsxPromptsx3 = (np.asarray(x, float).reshape((-1,) + np.shape(x)[-2:])
                                          for x in (a, b))
  s, p = a_SeedsxPromptsx3.shape[:2]
  rng = np.random.default_rng(seed)
  idx_DrawsxSeedsxPrompts = rng.integers(0, p, size=(samples, s, p))
  weight_DrawsxSeedsxPrompts = np.zeros((samples, s, p))
  np.add.at(weight_DrawsxSeedsxPrompts,
            (np.arange(samples)[:, None, None], np.arange(s)[None, :, None], idx_DrawsxSeedsxPrompts), 1.0)
  if s > 1:
    seeds_DrawsxSeeds = rng.integers(0, s, size=(samples, s))
    times_DrawsxSeeds = np.zeros((samples, s))
    np.add.at(times_DrawsxSeeds, (np.arange(samples)[:, None], seeds_DrawsxSeeds), 1.0)
    weight_DrawsxSeedsxPrompts *= times_DrawsxSeeds[..., None]

  def rates(w, x):  # (AR1, tokens per forward) of seed-prompts weighted by w; nan without steps
    sums = np.einsum('...sp,spc->...c', w, x)  # s: Seeds, p: Prompts, c: the 3 counts
    steps = np.where(sums[..., 0] > 0, sums[..., 0], np.nan)
    return sums[..., 1] / steps, 1.0 + sums[..., 2] / steps
  full_a, full_b = (rates(np.ones((s, p)), x) for x in (a_SeedsxPromptsx3, b_SeedsxPromptsx3))
  boot_a, boot_b = (rates(weight_DrawsxSeedsxPrompts, x) for x in (a_SeedsxPromptsx3, b_SeedsxPromptsx3))
  # Row i weighs seed i's prompts alone.
  seed_SeedsxSeedsxPrompts = np.repeat(np.eye(s)[:, :, None], p, axis=2)
  per_seed = (rates(seed_SeedsxSeedsxPrompts, a_SeedsxPromptsx3)[0]
              - rates(seed_SeedsxSeedsxPrompts, b_SeedsxPromptsx3)[0])
  out = {'prompts': p, 'seeds': s, 'ar1_per_seed': [float(x) for x in per_seed]}
  for i, key in enumerate(('ar1', 'tokens_per_forward')):
    d_Draws = boot_a[i] - boot_b[i]
    finite = d_Draws[np.isfinite(d_Draws)]
    lo, hi = np.percentile(finite, [2.5, 97.5]) if finite.size else (np.nan, np.nan)
    out[key] = {'diff': float(full_a[i] - full_b[i]), 'lo': float(lo), 'hi': float(hi), 'verdict': _verdict(lo, hi)}
  return out


def _verdict(lo: float, hi: float) -> str:
  return 'higher' if lo > 0 else 'lower' if hi < 0 else 'inconclusive'


def seed_interval(diffs) -> dict | None:
  """The mean of per-seed paired differences and its 95% t-interval over the seeds (None below two):
  for what is measured once per seed, such as the main head's held-out accuracy."""
  import scipy.stats  # here, not at the top: a run that computes no interval skips its import
  d_Seeds = np.asarray([x for x in diffs if x is not None and np.isfinite(x)], float)
  n = len(d_Seeds)
  if n < 2:
    return None
  mean = float(d_Seeds.mean())
  half = float(scipy.stats.t.ppf(0.975, n - 1) * d_Seeds.std(ddof=1) / np.sqrt(n))
  return {'diff': mean, 'lo': mean - half, 'hi': mean + half, 'seeds': n,
          'verdict': _verdict(mean - half, mean + half)}


def _main_head(pairs) -> dict:
  """Seed-paired intervals of the main head's held-out accuracy and mean prompt-set accuracy;
  `pairs`: (row's eval, reference's eval) of each seed both have."""
  out = {'heldout_acc': seed_interval([a['heldout']['accuracy'] - b['heldout']['accuracy'] for a, b in pairs]),
         'prompt_acc': seed_interval([(set_mean(a, lambda p: p.get('main_accuracy')) or np.nan)
                                      - (set_mean(b, lambda p: p.get('main_accuracy')) or np.nan) for a, b in pairs])}
  return {k: v for k, v in out.items() if v is not None}


def paired_differences(rows, references: dict[str, str]) -> dict:
  """{label: {'reference': ref, 'sets': {set: paired_bootstrap}, 'main': {...}, 'unpaired': {...}}}
  for every row with a reference; with several prompt sets, 'all' pools their prompts (one verdict
  per row). 'main' holds `seed_interval`s of the main head's accuracy (with two or more seeds).

  Seeds pair up by their id (`evals_by_seed`: seed s of the row with seed s of its reference, the
  same data order and initial shift), never by position: a seed that only one side has is left out
  of the pair, and 'unpaired' names it ({'row': [...], 'reference': [...]}; empty when none), which
  the report prints as a warning. `paired_bootstrap` resamples the paired seeds and the prompts.
  """
  by_label = dict(rows)
  out = {}
  for label, runs in rows:
    ref = references.get(label)
    mine, theirs = evals_by_seed(runs), evals_by_seed(by_label.get(ref, []))
    seeds = sorted(mine.keys() & theirs.keys())
    if ref is None or not seeds:
      continue
    pairs = [(mine[s], theirs[s]) for s in seeds]
    sets, stacked = {}, {}
    for name in sorted(set(pairs[0][0]['prompt_sets']) & set(pairs[0][1]['prompt_sets'])):
      counts = [(_prompt_counts(a, name), _prompt_counts(b, name)) for a, b in pairs]
      counts = [(a, b) for a, b in counts if a is not None and b is not None and a.shape == b.shape]
      counts = [(a, b) for a, b in counts if a.shape == counts[0][0].shape]  # every seed decodes the same prompts
      if counts:
        stacked[name] = np.stack([a for a, _ in counts]), np.stack([b for _, b in counts])
        sets[name] = paired_bootstrap(*stacked[name])
    if len({a.shape[0] for a, _ in stacked.values()}) == 1 and len(stacked) > 1:  # the same seeds in every set
      sets['all'] = paired_bootstrap(*(np.concatenate(x, axis=1) for x in zip(*stacked.values())))
    if sets:
      unpaired = {'row': sorted(mine.keys() - theirs.keys()), 'reference': sorted(theirs.keys() - mine.keys())}
      out[label] = {'reference': ref, 'sets': sets, 'main': _main_head(pairs),
                    'unpaired': {k: v for k, v in unpaired.items() if v}}
  return out


def unpaired_warnings(paired: dict) -> list[str]:
  """One warning line per row whose seeds and its reference's differ (a run skipped or lost)."""
  lines = []
  for label, entry in paired.items():
    for side, seeds in entry.get('unpaired', {}).items():
      owner, other = (label, entry['reference']) if side == 'row' else (entry['reference'], label)
      lines.append(f'Warning: seed{"s" if len(seeds) > 1 else ""} {", ".join(map(str, seeds))} of "{owner}" '
                   f'{"have" if len(seeds) > 1 else "has"} no counterpart in "{other}" and '
                   f'{"are" if len(seeds) > 1 else "is"} left out of their paired differences.')
  return lines
