"""decode_speed's side-by-side summaries: each variant's acceptance and tokens/s against the setting
it varies (the whole draft vocabulary, the full chain, the chain beside a tree, the best fixed
setting beside the planner's pick), all decoded in the same process."""


def draft_vocab_effect(sets: dict, depths, vocabs) -> dict:
  """Per set, batch and depth: each draft-vocabulary size's AR1 minus the whole vocabulary's, and its
  speculative tokens/s over the whole vocabulary's (both decoded in this process)."""
  out = {}
  for name, by_batch in sets.items():
    for b, runs in by_batch.items():
      for depth in depths:
        full = runs[f'depth{depth}_dv0']
        out[f'{name}/{b}/depth{depth}'] = {
            n: {'ar1_minus_full': runs[f'depth{depth}_dv{n}']['ar'][0] - full['ar'][0],
                'spec_tokens_per_s_over_full': runs[f'depth{depth}_dv{n}']['spec_tokens_per_s'] / full['spec_tokens_per_s']}
            for n in vocabs if n}
  return out


def adaptive_effect(sets: dict, keys: dict) -> dict:
  """Per set, batch and chain (key without the threshold): each threshold's tokens/forward and
  speculative tokens/s over the full chain's (threshold 0, decoded in this process)."""
  out = {}
  for name, by_batch in sets.items():
    for b, runs in by_batch.items():
      for chain, by_p in keys.items():
        full = runs[by_p[0.0]]
        out[f'{name}/{b}/{chain}'] = {
            p: {'tokens_per_forward': runs[k]['tokens_per_forward'],
                'tokens_per_forward_full': full['tokens_per_forward'],
                'spec_tokens_per_s_over_full': runs[k]['spec_tokens_per_s'] / full['spec_tokens_per_s'],
                'lossless': runs[k]['lossless']}
            for p, k in by_p.items() if p}
  return out


def tree_effect(sets: dict, keys: dict) -> dict:
  """Per set, batch and chain: the tree's acceptance length and tokens/forward beside the chain's,
  and its speculative tokens/s over the chain's (both decoded in this process)."""
  out = {}
  for name, by_batch in sets.items():
    for b, runs in by_batch.items():
      for chain, tree_key in keys.items():
        c, t = runs[chain], runs[tree_key]
        out[f'{name}/{b}/{chain}'] = {'accept_len': t['accept_len'], 'accept_len_chain': c['accept_len'],
                                      'tokens_per_forward': t['tokens_per_forward'],
                                      'spec_tokens_per_s_over_chain': t['spec_tokens_per_s'] / c['spec_tokens_per_s'],
                                      'lossless': t['lossless']}
  return out


def auto_effect(sets: dict) -> dict:
  """Per set and batch: the planner's pick and its measured speedup over plain, beside the best
  fixed setting's (each timed side by side with plain decoding in this process)."""
  out = {}
  for name, by_batch in sets.items():
    for b, runs in by_batch.items():
      if 'auto' not in runs:
        continue
      fixed = {k: r['speedup_measured'] for k, r in runs.items() if k != 'auto'}
      best = max(fixed, key=fixed.get)
      auto = runs['auto']
      out[f'{name}/{b}'] = {'setting': auto['setting'], 'speedup': auto['speedup_measured'],
                            'best_fixed': best, 'best_fixed_speedup': fixed[best],
                            'over_best_fixed': auto['speedup_measured'] / fixed[best], 'lossless': auto['lossless']}
  return out
