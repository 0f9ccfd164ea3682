"""Drafts from the context: prompt lookup, the drafting source that needs no model
(docs/design.md, "Drafts from the context"; `drafting.draft` verifies them)."""

import jax.numpy as jnp

from mtpd_jax.shifts import gather_at


def context_drafts(tokens_BxS, length_B, depth: int, ngram: int):
  """Prompt lookup (Saxena 2023; llama.cpp's lookup decoding): the `depth` tokens that followed
  an earlier occurrence of the sequence's last n tokens, the longest n <= `ngram` that occurs; of
  its occurrences, the latest that `depth` committed tokens follow, else the latest. Returns
  (drafts_BxJ, found_BxJ): draft j is proposed only where a match was found and position e+j is a
  committed token (e: where the match ends, at most L-1 for the pending token L).
  No training and no model: the drafts depend on the committed tokens only, so they are a fixed
  draw (q = one-hot), and verification keeps decoding lossless."""
  b, s = tokens_BxS.shape
  pending_B1 = (length_B - 1)[:, None]
  pos_S = jnp.arange(s)
  end_B = jnp.full((b,), -1, jnp.int32)
  for n in range(ngram, 0, -1):  # a longer n-gram's match wins
    match_BxS = (pos_S >= n - 1) & (pos_S <= pending_B1 - 1) & (pending_B1 >= n - 1)
    for t in range(n):  # token e-t equals token L-t
      match_BxS &= tokens_BxS[:, jnp.maximum(pos_S - t, 0)] == gather_at(tokens_BxS, pending_B1 - t)
    latest_B = jnp.max(jnp.where(match_BxS, pos_S, -1), axis=1)
    followed_B = jnp.max(jnp.where(match_BxS & (pos_S <= pending_B1 - depth), pos_S, -1), axis=1)
    end_B = jnp.where(end_B < 0, jnp.where(followed_B >= 0, followed_B, latest_B), end_B)
  at_BxJ = end_B[:, None] + jnp.arange(1, depth + 1)
  found_BxJ = (end_B[:, None] >= 0) & (at_BxJ <= pending_B1)
  return jnp.where(found_BxJ, gather_at(tokens_BxS, jnp.clip(at_BxJ, 0, s - 1)), 0).astype(jnp.int32), found_BxJ
