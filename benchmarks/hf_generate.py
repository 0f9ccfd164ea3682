"""Hugging Face transformers' greedy `generate` on token-id prompts, plain and with prompt-lookup decoding.

The reference for benchmarks/decode_speed.py: the same GGUF checkpoint, loaded by transformers as
benchmarks/hf_parity.py does (f32, offline), decoding one prompt at a time on all of PyTorch's CPU
threads. Prompt-lookup decoding (`prompt_lookup_num_tokens`) drafts by matching the last n-gram
against the prompt and verifies greedily, so it is transformers' own lossless draft-free speed-up. `side_by_side` sets it against our batch-1
results on the same prompts.
"""

import math
import os
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # never reach a hub: the GGUF file is local

import numpy as np

from benchmarks.hf_parity import hf_load
from mtpd_jax import decode
from mtpd_jax.model import MTPTransformer


def available() -> bool:
  """Whether torch and transformers import here."""
  try:
    import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import transformers  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


def timed_generate(path: str, prompts, *, max_new_tokens: int, stop_tokens, repeats: int = 3,
                   lookup_tokens: int = 10) -> dict:
  """New tokens of every prompt and tokens/s, for 'plain' and 'lookup' greedy decoding at batch 1.

  One untimed call of each setting warms up; then `repeats` passes over all prompts alternate
  between the settings, and a setting's time is the sum over prompts of each prompt's best, as
  mtpd_jax.harness.evaluate.timed_decode times ours. Generation stops at any of `stop_tokens` (kept in
  the output, as ours keeps it) or after `max_new_tokens`.
  """
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count())
  start = time.perf_counter()
  _, model = hf_load(path)
  load_s = time.perf_counter() - start
  stop = [int(t) for t in stop_tokens]
  settings = {'plain': {}, 'lookup': {'prompt_lookup_num_tokens': lookup_tokens}}

  def run(prompt, kwargs):
    ids_1xT = torch.tensor(np.asarray(prompt, np.int64)[None])
    start = time.perf_counter()
    with torch.inference_mode():
      out_1xS = model.generate(ids_1xT, attention_mask=torch.ones_like(ids_1xT), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=stop or None,
                               pad_token_id=stop[0] if stop else None, **kwargs)
    return out_1xS[0, ids_1xT.shape[1]:].numpy().astype(np.int32), time.perf_counter() - start

  for kwargs in settings.values():
    run(prompts[0], kwargs)
  tokens, best = {}, {}
  for _ in range(max(repeats, 1)):
    for name, kwargs in settings.items():
      for i, prompt in enumerate(prompts):
        tokens[name, i], seconds = run(prompt, kwargs)
        best[name, i] = min(best.get((name, i), math.inf), seconds)
  out = {'load_s': load_s, 'threads': torch.get_num_threads()}
  for name in settings:
    toks = [tokens[name, i] for i in range(len(prompts))]
    seconds = sum(best[name, i] for i in range(len(prompts)))
    out[name] = {'tokens': toks, 'seconds': seconds, 'tokens_per_s': sum(map(len, toks)) / seconds}
  return out


def side_by_side(model: MTPTransformer, path: str, sets: dict, b1: dict, *, stop, pad_multiple: int, args) -> dict:
  """HF transformers (plain, prompt lookup) against our batch-1 results `b1` (set -> result) on the same prompts.

  Our plain greedy outputs are decoded once more here (the same call as the timed one) for the
  token-for-token comparison and to count the tokens behind our plain tokens/s.
  """
  everything = [p for ps in sets.values() for p in ps]
  hf = timed_generate(path, everything, max_new_tokens=args.max_new_tokens, stop_tokens=stop,
                                  repeats=args.repeats, lookup_tokens=args.lookup_tokens)
  structure, leaves = decode.split(model)
  plain = decode.options(args.max_new_tokens, stop_tokens=stop)
  ours = [decode.generate_split(structure, leaves, [p], plain, pad_multiple=pad_multiple).tokens[0] for p in everything]
  plain_tokens, plain_s, spec_tokens, spec_s, i = 0, 0.0, 0, 0.0, 0
  for name, ps in sets.items():  # seconds of each set's timed runs, recovered from its tokens/s
    n, r = sum(map(len, ours[i:i + len(ps)])), b1[name]
    plain_tokens, plain_s = plain_tokens + n, plain_s + n / r['plain_tokens_per_s']
    spec_tokens, spec_s = spec_tokens + r['new_tokens'], spec_s + r['new_tokens'] / r['spec_tokens_per_s']
    i += len(ps)
  equal = lambda a, b: len(a) == len(b) and bool(np.all(a == b))
  prefix = lambda a, b: int(np.argmin(np.append(a[:len(b)] == b[:len(a)], False)))
  hf_plain, hf_lookup = hf['plain']['tokens'], hf['lookup']['tokens']
  ours_plain_tps, ours_spec_tps = plain_tokens / plain_s, spec_tokens / spec_s
  return {
      'hf_prompts': len(everything), 'hf_load_s': hf['load_s'], 'hf_threads': hf['threads'],
      'hf_plain_tokens_per_s': hf['plain']['tokens_per_s'], 'hf_lookup_tokens_per_s': hf['lookup']['tokens_per_s'],
      'ours_plain_tokens_per_s': ours_plain_tps, 'ours_spec_tokens_per_s': ours_spec_tps,
      'ours_plain_over_hf_plain': ours_plain_tps / hf['plain']['tokens_per_s'],
      'ours_spec_over_hf_plain': ours_spec_tps / hf['plain']['tokens_per_s'],
      'ours_spec_over_hf_lookup': ours_spec_tps / hf['lookup']['tokens_per_s'],
      'hf_greedy_equal': sum(map(equal, ours, hf_plain)),  # f32 on both sides, but not bitwise: reported, not asserted
      'hf_greedy_common_prefix_mean': float(np.mean([prefix(a, b) for a, b in zip(ours, hf_plain)])),
      'hf_lookup_equal_hf_plain': sum(map(equal, hf_lookup, hf_plain)),
      'hf_new_tokens': sum(map(len, hf_plain)), 'ours_new_tokens': plain_tokens,
  }
