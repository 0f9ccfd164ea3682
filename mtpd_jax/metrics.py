"""Speculative-decoding metrics (the paper's Tables 1 and 7; definitions in docs/design.md, "Metrics"): AR, CAR, accepted length, and teacher-forced agreement.

Dimension letters: the legend in mtpd_jax/__init__.py (J draft depth, I steps). A speculative step drafts
J tokens (depth k drafts the k-th token after the main head's) and verification accepts the
longest prefix of them: a_s in {0..J} accepted drafts at step s. Over a set of steps:
  AR_k   acceptance rate of depth (head) k: drafts accepted at depth k / steps that reached depth k,
         where a step reaches depth k iff its drafts 1..k-1 were all accepted (a_s >= k-1). It is
         conditional on the earlier drafts; AR_1 is over all steps.
  CAR_k  cumulative acceptance rate: the fraction of steps whose drafts 1..k were all accepted
         (a_s >= k). Hence CAR_k = prod_{j<=k} AR_j, and CAR_1 = AR_1.
  accept_len          mean accepted drafts per step, mean_s a_s = sum_k CAR_k (the bonus token is
                      not counted).
  tokens_per_forward  tokens emitted per main-model (verify) forward = 1 + accept_len: each step
                      emits its accepted drafts plus one token of the main head's own (the bonus
                      after J acceptances, else the main head's token in place of the rejected
                      draft). Truncation of a sequence's last step (stop token, max_new_tokens)
                      is not counted against it.
Teacher-forced agreement on a token sequence x: depth k at position i agrees iff the argmax of
the depth-k logits at i equals the argmax of the main logits at i+k (both predict token i+k+1).
The chain starting at i accepts a_i = the number of leading agreeing depths 1, 2, ...; counting
the chains as steps gives the teacher-forced AR/CAR (AR_k: agreement at depth k given agreement
at depths < k in the same chain). On the model's own greedy continuation, the chains that start
at the online steps' last trunk positions are exactly the online greedy acceptances.
"""

import numpy as np


def acceptance_counts(accept_lengths, draft_depth: int) -> tuple[np.ndarray, np.ndarray]:
  """(reached_J, accepted_J): steps that reached depth k and steps that accepted it, k = 1..J."""
  a_Steps = np.asarray(accept_lengths).reshape(-1)
  if a_Steps.size and (a_Steps.min() < 0 or a_Steps.max() > draft_depth):
    raise ValueError(f'accepted lengths must lie in [0, {draft_depth}]; got {a_Steps.min()}..{a_Steps.max()}')
  k_J = np.arange(1, draft_depth + 1)
  reached_J = np.sum(a_Steps[:, None] >= k_J - 1, axis=0)
  accepted_J = np.sum(a_Steps[:, None] >= k_J, axis=0)
  return reached_J, accepted_J


def acceptance_stats(accept_lengths, draft_depth: int) -> dict:
  """ar, car (per depth; nan where no step reached it), accept_len, tokens_per_forward, steps."""
  a_Steps = np.asarray(accept_lengths).reshape(-1)
  reached_J, accepted_J = acceptance_counts(a_Steps, draft_depth)
  steps = int(a_Steps.size)
  with np.errstate(invalid='ignore', divide='ignore'):
    ar_J = accepted_J / reached_J
    car_J = accepted_J / steps if steps else np.full(draft_depth, np.nan)
  accept_len = float(a_Steps.mean()) if steps else float('nan')
  return {'ar': [float(x) for x in ar_J], 'car': [float(x) for x in car_J],
          'accept_len': accept_len, 'tokens_per_forward': 1.0 + accept_len, 'steps': steps}


def per_prompt_counts(accept_lengths_per_prompt) -> dict[str, list[int]]:
  """Per prompt: speculative steps, steps that accepted the depth-1 draft, and accepted drafts.

  AR_1 of a set of prompts is sum(accepted_1) / sum(steps), and its tokens per forward
  1 + sum(accepted) / sum(steps), so these sums are enough to resample prompts.
  """
  a = [np.asarray(x).reshape(-1) for x in accept_lengths_per_prompt]
  return {'steps': [int(x.size) for x in a], 'accepted_1': [int(np.sum(x >= 1)) for x in a],
          'accepted': [int(np.sum(x)) for x in a]}


def teacher_forced_agreement(main_BxT, draft_JxBxT) -> np.ndarray:
  """agree_JxBxT: depth k's argmax at i == the main argmax at i+k (False where i+k is past the end).

  `main_BxT`, `draft_JxBxT`: the argmax token ids of the main and depth-k logits.
  """
  main_BxT, draft_JxBxT = np.asarray(main_BxT), np.asarray(draft_JxBxT)
  j, _, t = draft_JxBxT.shape
  agree_JxBxT = np.zeros(draft_JxBxT.shape, bool)
  for k in range(1, min(j, t - 1) + 1):
    agree_JxBxT[k - 1, :, :t - k] = draft_JxBxT[k - 1, :, :t - k] == main_BxT[:, k:]
  return agree_JxBxT


def teacher_forced_accept_lengths(main_BxT, draft_JxBxT, valid_BxT=None) -> np.ndarray:
  """Leading agreements a_i of the chain at each position (-1 where i..i+J are not all valid)."""
  agree_JxBxT = teacher_forced_agreement(main_BxT, draft_JxBxT)
  j, b, t = agree_JxBxT.shape
  valid_BxT = np.ones((b, t), bool) if valid_BxT is None else np.asarray(valid_BxT, bool)
  n = max(t - j, 0)  # chains that end inside the sequence start at 0..t-1-j
  fits_BxT = np.zeros((b, t), bool)
  fits_BxT[:, :n] = valid_BxT[:, :n]
  for k in range(1, j + 1):
    fits_BxT[:, :n] &= valid_BxT[:, k:n + k]
  accept_BxT = np.sum(np.cumprod(agree_JxBxT, axis=0), axis=0)
  return np.where(fits_BxT, accept_BxT, -1).astype(np.int32)


def teacher_forced_stats(main_BxT, draft_JxBxT, valid_BxT=None) -> dict:
  """`acceptance_stats` of the teacher-forced chains at every valid start, plus unconditional agreement.

  Takes argmax ids like `teacher_forced_agreement`.
  """
  accept_BxT = teacher_forced_accept_lengths(main_BxT, draft_JxBxT, valid_BxT)
  starts_BxT = accept_BxT >= 0
  agree_JxBxT = teacher_forced_agreement(main_BxT, draft_JxBxT)
  stats = acceptance_stats(accept_BxT[starts_BxT], agree_JxBxT.shape[0])
  with np.errstate(invalid='ignore'):
    stats['agreement'] = [float(x) for x in agree_JxBxT[:, starts_BxT].mean(axis=1)]
  return stats
