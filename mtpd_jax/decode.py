"""KV-cache decoding: plain greedy/sampled generation and self-speculative decoding with the MTP heads.

Dimension letters: the legend in mtpd_jax/__init__.py.

Per sequence, `length` tokens are committed; the last one, at the *pending* position L = length-1,
is chosen but not yet run through the trunk, whose cache holds positions < L. Every call runs in
one jit per (batch shape, `DecodeOptions`); `generate` loops steps in a `lax.while_loop`.

Plain step: trunk(token L) -> main logits at L -> the next token is committed at L+1.

Speculative step (docs/design.md, "Metrics"), verify first then draft, so prefill ends with a draft pass too:
  1. Verify: one trunk call over the pending token and drafts d_1..d_J at positions L..L+J gives
     main logits at L..L+J. `sampling.verify` accepts the longest prefix d_1..d_a (greedy: equal
     to the main argmax; sampling: the lossless min(1, p/q) rule) and picks the next token (main
     argmax / residual sample / bonus). d_1..d_a and that token are committed (a+1 tokens per
     trunk call). Rejected positions roll back for free: the length does not advance over them,
     and the next verify rewrites their cache slots before any query can see them.
  2. Draft: depth j = 1..J runs head ((j-1) mod K)+1 (training-free looping, MTP-D* of Table 8 — its own
     weights, but its own cache, since depth j's inputs differ from depth j-K's) at the last
     trunk position L-1, on h^{j-1} and the token L-1+j (the pending token for j = 1, then
     d_{j-1}); the depth-j logits there give d_j, written at position L+j.

Cache scheme (exact teacher-forced semantics). Every depth j keeps its own one-layer cache whose
slot i must hold the keys that the teacher-forced model computes at i: from h^{j-1}_i and token
i+j (`looped_forward` is that model). Slot i is *final* once token i+j is committed. The drafts
make the model's inputs known up to position L-1+j, so each draft pass re-runs every depth over
the window [L-2J, L-1] (clipped at 0): it covers all slots that were not final after the previous
pass (i > L_prev - j, and L - L_prev <= J+1), uses the trunk states h^0 kept by position from the
verify calls and h^{j-1} from depth j-1 over the same window, and fills the not-yet-final slots
with the current drafts. So the depth-j draft logits equal the teacher-forced depth-j logits at
L-1 on (committed tokens, d_1..d_{j-1}), whatever was accepted or rolled back before; on the
model's own greedy output the online acceptances thus equal the teacher-forced agreement chains.
The price is 2J positions per head call instead of one (same number of sequential calls).

Adaptive depth (`draft_min_prob` > 0; docs/design.md, "Decoding cost"): a sequence proposes the
leading drafts whose head put at least `draft_min_prob` on its most likely token, a choice made
before any draw, so sampling stays lossless; verification rejects the rest (sampled: with q = 0),
and the logits of a depth where no sequence of the batch still drafts are skipped.

Tree drafts (`tree`; mtpd_jax/draft_tree.py): each path is a batch row holding a chain as above,
whose depth j runs once per node of depth j-1; one tree attention pass verifies the distinct
nodes, and every row adopts the path that `draft_tree.accept` commits.

Slots past a sequence's own window may hold stale drafts or prompt padding (ragged batches run
on padded prompts at per-sequence positions); they are never visible, because every call writes
the slots of all positions it queries and a query sees only slots <= its position.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpd_jax import draft_tree, sampling
from mtpd_jax.model import (Cache, ModelConfig, MTPTransformer, attention_mask, cache_mask, init_cache,
                            out_major_params, set_out_major)
from mtpd_jax.shifts import shift_left


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """Static decoding settings; one compilation per distinct value (and batch shape)."""
  max_new_tokens: int
  draft_depth: int = 0            # J drafts per step; 0 = plain decoding
  temperature: float = 0.0        # 0 = greedy
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  draft_min_prob: float = 0.0     # adaptive depth: stop drafting below this top probability (0 = always J)
  tree: tuple[int, ...] = ()      # tree drafts: branching per depth (mtpd_jax/draft_tree.py); () = a chain

  def __post_init__(self):
    if not 0.0 <= self.draft_min_prob <= 1.0:
      raise ValueError(f'draft_min_prob={self.draft_min_prob} must lie in [0, 1]')
    draft_tree.check(self.tree, self.draft_depth)


class DecodeState(NamedTuple):
  """Everything a decoding step reads and writes, by position; the last three are speculative only."""
  tokens_BxS: jax.Array           # prompt, committed tokens, then (speculative) the current drafts
  length_B: jax.Array             # committed tokens (prompt included); the last is pending
  prompt_len_B: jax.Array
  done_B: jax.Array               # stop token or max_new_tokens reached
  step: jax.Array                 # decoding steps taken (prefill excluded)
  key: jax.Array
  caches: list[Cache]             # trunk, valid for positions < length-1 (a tree: one row per sequence)
  logits_BxV: jax.Array           # main logits at length-2, from which the pending token was chosen
  accept_BxI: jax.Array | None = None          # accepted drafts at step i; -1 when not active
  h0_BxSxD: jax.Array | None = None            # trunk hidden states by position
  head_caches: list[Cache] | None = None       # one per draft depth
  draft_logits_BxJxV: jax.Array | None = None  # sampling only: depth-j logits that drafted tokens[length-1+j]
  num_drafts_B: jax.Array | None = None        # adaptive depth only: drafts proposed for the next verify


class DraftVocab(NamedTuple):
  """A draft vocabulary: drafts are chosen among U token ids only. Verification uses the main head
  over the whole vocabulary, so decoding stays lossless: a sampled draft's q is a proper
  distribution over the U ids, zero elsewhere, which min(1, p/q) accepts exactly (docs/design.md)."""
  ids_U: jax.Array    # int32 token ids
  w: jax.Array        # their entries of the model's `output_matrix()` (D x U, or U x D out-major)


def draft_vocab(model: MTPTransformer, ids_U) -> DraftVocab:
  """The draft vocabulary of these token ids (gathered once, outside the decoding loop)."""
  ids_U = jnp.asarray(ids_U, jnp.int32)
  return DraftVocab(ids_U, jnp.take(model.output_matrix(), ids_U, axis=0 if model.out_major else 1))


def head_for_depth(j: int, num_heads: int) -> int:
  """The MTP head (1-based) that drafts at depth j: ((j-1) mod K)+1."""
  return (j - 1) % num_heads + 1


def cache_len(prompt_len: int, opts: DecodeOptions) -> int:
  """Cache slots: the padded prompt, max_new_tokens and one verify call's tokens (chain or tree)."""
  return prompt_len + opts.max_new_tokens + (draft_tree.num_nodes(opts.tree) if opts.tree else opts.draft_depth + 1)


def _gather(x_BxS, pos_BxW):
  """x[b, pos[b, w]] along axis 1 (positions past the end clip to it; only unused slots go there)."""
  idx = jnp.clip(pos_BxW, 0, x_BxS.shape[1] - 1).reshape(pos_BxW.shape + (1,) * (x_BxS.ndim - 2))
  return jnp.take_along_axis(x_BxS, idx, axis=1)


def _write(x_BxS, pos_BxW, val_BxW, keep_BxW=None):
  """x[b, pos[b, w]] = val[b, w] where `keep`; other and out-of-range writes are dropped."""
  if keep_BxW is not None:
    pos_BxW = jnp.where(keep_BxW, pos_BxW, x_BxS.shape[1])
  return x_BxS.at[jnp.arange(x_BxS.shape[0])[:, None], pos_BxW].set(val_BxW, mode='drop')


def _commit(st: DecodeState, emit_BxJ1, n_B, opts: DecodeOptions):
  """Append the first n of `emit` to each active sequence, cut after a stop token or max_new_tokens."""
  idx_J1 = jnp.arange(emit_BxJ1.shape[1])
  n_B = jnp.minimum(n_B, opts.max_new_tokens - (st.length_B - st.prompt_len_B))
  stopped_B = jnp.zeros_like(st.done_B)
  if opts.stop_tokens:
    stop_BxJ1 = jnp.isin(emit_BxJ1, jnp.asarray(opts.stop_tokens)) & (idx_J1 < n_B[:, None])
    stopped_B = jnp.any(stop_BxJ1, axis=1)
    n_B = jnp.where(stopped_B, jnp.argmax(stop_BxJ1, axis=1) + 1, n_B)
  n_B = jnp.where(st.done_B, 0, n_B)
  tokens_BxS = _write(st.tokens_BxS, st.length_B[:, None] + idx_J1, emit_BxJ1, idx_J1 < n_B[:, None])
  length_B = st.length_B + n_B
  done_B = st.done_B | stopped_B | (length_B - st.prompt_len_B >= opts.max_new_tokens)
  return st._replace(tokens_BxS=tokens_BxS, length_B=length_B, done_B=done_B)


def prefill(model: MTPTransformer, prompt_BxP, prompt_len_B, key, opts: DecodeOptions,
            vocab: DraftVocab | None = None) -> DecodeState:
  """Run the (right-padded) prompts, choose the first new token and, if speculative, the first drafts."""
  cfg = model.cfg
  b, p = prompt_BxP.shape
  s = cache_len(p, opts)
  pos_BxP = jnp.broadcast_to(jnp.arange(p), (b, p))
  h_BxPxD, caches = model.trunk(prompt_BxP, pos_BxP, cache_mask(pos_BxP, s),
                                init_cache(cfg, b, s, cfg.num_layers))
  logits_BxV = model.logits(_gather(h_BxPxD, prompt_len_B[:, None] - 1))[:, 0]
  key, key_first, key_draft = jax.random.split(key, 3)
  first_B = sampling.choose(key_first, logits_BxV, opts.temperature, opts.top_p)
  st = DecodeState(
      tokens_BxS=jnp.zeros((b, s), jnp.int32).at[:, :p].set(prompt_BxP), length_B=prompt_len_B,
      prompt_len_B=prompt_len_B, done_B=jnp.zeros((b,), bool), step=jnp.zeros((), jnp.int32),
      key=key, caches=caches, logits_BxV=logits_BxV)
  st = _commit(st, first_B[:, None], jnp.ones_like(prompt_len_B), opts)
  if not opts.draft_depth:
    return st
  if not cfg.num_mtp_heads:
    raise ValueError('speculative decoding needs a model with MTP heads (num_mtp_heads >= 1)')
  st = st._replace(
      accept_BxI=jnp.full((b, opts.max_new_tokens), -1, jnp.int32),
      h0_BxSxD=jnp.zeros((b, s, cfg.dim), h_BxPxD.dtype).at[:, :p].set(h_BxPxD))
  if opts.tree:  # one row per path of the tree; the trunk caches stay one per sequence
    st = draft_tree.tile(st._replace(caches=None), draft_tree.num_paths(opts.tree), b)._replace(caches=st.caches)
  st = st._replace(head_caches=[init_cache(cfg, b * n, s, num_layers=1)[0]  # a tree: one row per node of depth j-1
                                for n in draft_tree.level_sizes(opts.tree or (1,) * opts.draft_depth)[:-1]])
  return _draft(model, st, jnp.zeros_like(st.length_B), p, key_draft, opts, vocab)


def _draft(model: MTPTransformer, st: DecodeState, start_B, width: int, key, opts: DecodeOptions,
           vocab: DraftVocab | None):
  """Re-run depths 1..J over positions [start, start+width) and draft tokens L+1..L+J (see module doc)."""
  s = st.tokens_BxS.shape[1]
  pos_BxW = start_B[:, None] + jnp.arange(width)
  mask_BxWxS = cache_mask(pos_BxW, s)
  pending_B = st.length_B - 1
  last_Bx1 = (pending_B - 1 - start_B)[:, None]  # window index of the last trunk position L-1
  h_BxWxD, tokens_BxS = _gather(st.h0_BxSxD, pos_BxW), st.tokens_BxS
  head_caches, draft_logits = [], []
  drafting_B, num_drafts_B = jnp.ones(pending_B.shape, bool), jnp.zeros_like(pending_B)  # adaptive depth
  for j, key_j in zip(range(1, opts.draft_depth + 1), jax.random.split(key, opts.draft_depth)):
    rows = draft_tree.depth_rows(opts.tree, len(pending_B), j) if opts.tree else None
    group = (lambda x: x) if rows is None else (lambda x: x[rows.group_G])
    if rows is not None:  # a tree runs depth j once per node of depth j-1, on its first path's row
      h_BxWxD = group(h_BxWxD) if j == 1 else jnp.repeat(h_BxWxD, opts.tree[j - 2], axis=0)  # parent's states
    # Depth j at window position i reads h^{j-1}_i and token i+j, and predicts token i+j+1.
    h_BxWxD, cache = model.mtp_head(head_for_depth(j, model.cfg.num_mtp_heads), h_BxWxD,
                                    group(_gather(tokens_BxS, pos_BxW + j)), group(pos_BxW), group(mask_BxWxS),
                                    st.head_caches[j - 1])
    h_Bx1xD = _gather(h_BxWxD, group(last_Bx1))
    choose = functools.partial(_choose_draft, model, vocab, opts, key_j, rows)
    if opts.draft_min_prob and j > 1:  # skip the logits once no sequence drafts this deep
      skip = lambda _: (jnp.zeros(pending_B.shape, jnp.int32), jnp.zeros(pending_B.shape + (model.cfg.vocab_size,)))
      draft_B, logits_BxV = jax.lax.cond(jnp.any(drafting_B), choose, skip, h_Bx1xD)
    else:
      draft_B, logits_BxV = choose(h_Bx1xD)
    if opts.draft_min_prob:
      drafting_B &= draft_confidence(logits_BxV, draft_B, opts) >= opts.draft_min_prob
      num_drafts_B += drafting_B
    tokens_BxS = _write(tokens_BxS, (pending_B + j)[:, None], draft_B[:, None])
    head_caches.append(cache)
    draft_logits.append(logits_BxV)
  # Greedy verification reads no draft probabilities; only sampling carries them to the next step.
  return st._replace(tokens_BxS=tokens_BxS, head_caches=head_caches,
                     draft_logits_BxJxV=jnp.stack(draft_logits, axis=1) if opts.temperature else None,
                     num_drafts_B=num_drafts_B if opts.draft_min_prob else None)


def draft_confidence(logits_BxV, draft_B, opts: DecodeOptions):
  """What adaptive depth compares with `draft_min_prob`: the top probability of the distribution
  drafts are drawn from (greedy: the draft's own). `draft_B` is deliberately unused: a rule that
  read the drawn draft's probability would make proposing depend on the draw, and sampled output
  would no longer follow plain sampling (the decoding tests catch that rule)."""
  del draft_B
  return jnp.max(sampling.probs(logits_BxV, opts.temperature or 1.0, opts.top_p), axis=-1)


def _choose_draft(model: MTPTransformer, vocab: DraftVocab | None, opts: DecodeOptions, key,
                  rows: draft_tree.DepthRows | None, h_Bx1xD):
  """Each row's draft at this depth and its logits over V (-inf outside a draft vocabulary). A
  tree (`rows`): h holds one row per parent node, which drafts its b_j children (greedy: ranks
  0..b_j-1; sampling: independent draws), and each path's row takes its node's draft and its
  parent's logits."""
  logits_BxU = model.logits(h_Bx1xD, None if vocab is None else vocab.w)[:, 0]
  width = 1 if rows is None else rows.width
  draft_BxW = None
  if not opts.temperature:  # greedy needs only the argmax (or the top b_j) among the U columns
    draft_BxW = jnp.argmax(logits_BxU, axis=-1)[:, None] if rows is None else jax.lax.top_k(logits_BxU, width)[1]
    draft_BxW = draft_BxW if vocab is None else vocab.ids_U[draft_BxW]
  logits_BxV = logits_BxU if vocab is None else jnp.full(  # sampling reads q over V: 0 outside the vocabulary
      logits_BxU.shape[:1] + (model.cfg.vocab_size,), -jnp.inf, logits_BxU.dtype).at[:, vocab.ids_U].set(logits_BxU)
  if draft_BxW is None:
    draft_BxW = sampling.choose(key, jnp.repeat(logits_BxV, width, axis=0), opts.temperature, opts.top_p)
  draft_B = draft_BxW.reshape(-1).astype(jnp.int32)
  return (draft_B, logits_BxV) if rows is None else (draft_B[rows.node_R], logits_BxV[rows.parent_R])


def step(model: MTPTransformer, st: DecodeState, opts: DecodeOptions,
         vocab: DraftVocab | None = None) -> DecodeState:
  """One plain decoding step, or one speculative verify + draft step when opts.draft_depth > 0."""
  j, s = opts.draft_depth, st.tokens_BxS.shape[1]
  pos_BxJ1 = (st.length_B - 1)[:, None] + jnp.arange(j + 1)  # the pending token, then the drafts
  key, key_verify, key_draft = jax.random.split(st.key, 3)
  if opts.tree:  # one tree pass gives each row (path) its chain's view; all adopt the path committed
    tokens_BxJ1, h_BxJ1xD, logits_BxJ1xV, caches = draft_tree.verify_pass(model, st.tokens_BxS, st.length_B,
                                                                           st.caches, opts.tree)
    src_B, accepted_B, next_B = draft_tree.accept(key_verify, tokens_BxJ1, st.draft_logits_BxJxV, logits_BxJ1xV,
                                                  opts.tree, opts.temperature, opts.top_p, st.num_drafts_B)
    tokens_BxJ1, logits_BxJ1xV, h_BxJ1xD = (x[src_B] for x in (tokens_BxJ1, logits_BxJ1xV, h_BxJ1xD))
    caches = draft_tree.keep_path(caches, st.length_B, src_B, opts.tree)
  else:
    tokens_BxJ1 = _gather(st.tokens_BxS, pos_BxJ1)
    h_BxJ1xD, caches = model.trunk(tokens_BxJ1, pos_BxJ1, cache_mask(pos_BxJ1, s), st.caches)
    logits_BxJ1xV = model.logits(h_BxJ1xD)
    if j:
      accepted_B, next_B = sampling.verify(key_verify, tokens_BxJ1[:, 1:], st.draft_logits_BxJxV,
                                           logits_BxJ1xV, opts.temperature, opts.top_p, st.num_drafts_B)
    else:
      accepted_B = jnp.zeros_like(st.length_B)
      next_B = sampling.choose(key_verify, logits_BxJ1xV[:, 0], opts.temperature, opts.top_p)
  # Emit d_1..d_a, then the main head's token at index a.
  idx_J1 = jnp.arange(j + 1)
  emit_BxJ1 = jnp.where(idx_J1 == accepted_B[:, None], next_B[:, None], jnp.roll(tokens_BxJ1, -1, axis=1))
  new = _commit(st, emit_BxJ1, accepted_B + 1, opts)
  emitted_B = new.length_B - st.length_B  # a+1, or fewer after a stop token or max_new_tokens
  last_B = jnp.maximum(emitted_B - 1, 0)  # the main logits that chose the new pending token
  logits_BxV = jnp.take_along_axis(logits_BxJ1xV, last_B[:, None, None], axis=1)[:, 0]
  new = new._replace(step=st.step + 1, key=key, caches=caches,
                     logits_BxV=jnp.where(emitted_B[:, None] > 0, logits_BxV, st.logits_BxV))
  if not j:
    return new
  new = new._replace(
      h0_BxSxD=_write(st.h0_BxSxD, pos_BxJ1, h_BxJ1xD),
      accept_BxI=st.accept_BxI.at[:, st.step].set(jnp.where(st.done_B, -1, accepted_B), mode='drop'))
  return _draft(model, new, jnp.maximum(new.length_B - 1 - 2 * j, 0), 2 * j, key_draft, opts, vocab)


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
  """A model's graphdef and parameter treedef: one static jit argument, hashed once (not per call).
  `out_major`: the leaves hold the dense matrices out-major (`model.out_major_params`)."""
  graphdef: nnx.GraphDef
  treedef: Any
  digest: int
  cfg: ModelConfig
  out_major: bool = False

  def __hash__(self):
    return self.digest

  def __eq__(self, other):
    return self is other or (isinstance(other, Structure) and (self.digest, self.out_major, self.treedef)
                             == (other.digest, other.out_major, other.treedef) and self.graphdef == other.graphdef)

  def merge(self, leaves) -> MTPTransformer:
    model = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))
    return set_out_major(model) if self.out_major else model


def split(model: MTPTransformer, out_major: bool | None = None) -> tuple[Structure, list[jax.Array]]:
  """(structure, parameter leaves): what the jitted functions below take, cheap to pass per call.

  `out_major` (default: on the CPU backend) copies the dense matrices out-major once, here: XLA:CPU's
  fast orientation for a step's few rows (docs/design.md, "Decoding cost"; `model.dense`).
  """
  out_major = jax.default_backend() == 'cpu' if out_major is None else out_major
  graphdef, params = nnx.split(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(out_major_params(model, params) if out_major else params)
  return Structure(graphdef, treedef, hash((graphdef, treedef, out_major)), model.cfg, out_major), leaves


def decoding_model(structure: Structure, leaves) -> MTPTransformer:
  """The model that decodes: with `dtype='bfloat16'` its matrices are cast once, before any loop,
  so that every step reads half the bytes (norm scales stay f32, logits are f32 either way)."""
  model = structure.merge(leaves)
  dtype = jnp.dtype(model.cfg.dtype)
  if dtype == jnp.float32:
    return model
  return structure.merge([x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x
                          for x in leaves])


def _vocab(model: MTPTransformer, draft_ids_U) -> DraftVocab | None:
  return None if draft_ids_U is None else draft_vocab(model, draft_ids_U)


@functools.partial(jax.jit, static_argnames=('structure', 'opts'))
def jit_prefill(structure: Structure, leaves, prompt_BxP, prompt_len_B, key,
                opts: DecodeOptions, draft_ids_U=None) -> DecodeState:
  """`prefill` under jit."""
  model = decoding_model(structure, leaves)
  return prefill(model, prompt_BxP, prompt_len_B, key, opts, _vocab(model, draft_ids_U))


@functools.partial(jax.jit, static_argnames=('structure', 'opts'))
def jit_steps(structure: Structure, leaves, st: DecodeState, opts: DecodeOptions, num_steps,
              draft_ids_U=None) -> DecodeState:
  """Exactly `num_steps` steps (finished sequences ride along; one compilation for any count)."""
  model = decoding_model(structure, leaves)
  vocab = _vocab(model, draft_ids_U)
  return jax.lax.fori_loop(0, num_steps, lambda _, s: step(model, s, opts, vocab), st)


@functools.partial(jax.jit, static_argnames=('structure', 'opts'))
def jit_generate(structure: Structure, leaves, prompt_BxP, prompt_len_B, key, opts: DecodeOptions,
                 draft_ids_U=None):
  """Prefill, then steps until every sequence is done: (tokens_BxS, length_B, accept_BxI or None)."""
  model = decoding_model(structure, leaves)
  vocab = _vocab(model, draft_ids_U)
  st = prefill(model, prompt_BxP, prompt_len_B, key, opts, vocab)
  st = jax.lax.while_loop(lambda s: (s.step < opts.max_new_tokens) & ~jnp.all(s.done_B),
                          lambda s: step(model, s, opts, vocab), st)
  first = slice(None, None, draft_tree.num_paths(opts.tree))  # a tree's rows of a sequence agree: keep one
  return st.tokens_BxS[first], st.length_B[first], None if st.accept_BxI is None else st.accept_BxI[first]


def pad_prompts(prompts, multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad token-id prompts to a shared length (rounded up to `multiple`, to reuse compilations)."""
  lens_B = np.array([len(p) for p in prompts], np.int32)
  if lens_B.min() < 1:
    raise ValueError('every prompt needs at least one token')
  p = -(-int(lens_B.max()) // multiple) * multiple
  prompt_BxP = np.zeros((len(prompts), p), np.int32)
  for i, tokens in enumerate(prompts):
    prompt_BxP[i, :len(tokens)] = tokens
  return prompt_BxP, lens_B


def check_draft_vocab(ids, structure: Structure) -> np.ndarray:
  """Draft vocabulary ids as int32, each in [0, V) and distinct; anything else raises ValueError."""
  ids = np.asarray(ids)
  v = structure.cfg.vocab_size
  if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f'a draft vocabulary is a non-empty 1-D array of token ids, got shape {ids.shape} {ids.dtype}')
  if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != len(ids):
    raise ValueError(f'draft vocabulary ids must be distinct and in [0, {v})')
  return ids.astype(np.int32)


class Generation(NamedTuple):
  """What `generate` returns, per prompt."""
  tokens: list[np.ndarray]          # new tokens of each prompt (a final stop token included)
  accept_lengths: list[np.ndarray]  # accepted drafts at each speculative step; empty when plain


def generate(model: MTPTransformer, prompts, **kwargs) -> Generation:
  """Decode a batch of token-id prompts: plain when draft_depth == 0, else self-speculative.

  Keyword arguments (see `generate_split`): the fields of `DecodeOptions` (draft_depth above K
  loops the heads), seed, pad_multiple, and draft_vocab (token ids that drafts are chosen from,
  e.g. `frequent_tokens`; None = the whole vocabulary).
  """
  return generate_split(*split(model), prompts, **kwargs)


def generate_split(structure: Structure, leaves, prompts, *, max_new_tokens: int, draft_depth: int = 0,
                   temperature: float = 0.0, top_p: float = 1.0, stop_tokens=(), seed: int = 0,
                   pad_multiple: int = 16, draft_vocab=None, draft_min_prob: float = 0.0,
                   tree=()) -> Generation:
  """`generate` for a model split once by `split(model)` (saves the split on every call)."""
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens={max_new_tokens} must be >= 1')
  draft_ids_U = None if draft_vocab is None or not draft_depth else check_draft_vocab(draft_vocab, structure)
  opts = DecodeOptions(max_new_tokens, draft_depth, float(temperature), float(top_p),
                       tuple(int(t) for t in stop_tokens), float(draft_min_prob) if draft_depth else 0.0,
                       tuple(int(b) for b in tree))
  prompt_BxP, lens_B = pad_prompts(prompts, pad_multiple)
  tokens_BxS, length_B, accept_BxI = jax.device_get(
      jit_generate(structure, leaves, prompt_BxP, lens_B, jax.random.key(seed), opts, draft_ids_U))
  tokens = [tokens_BxS[b, lens_B[b]:length_B[b]] for b in range(len(prompts))]
  accepts = [np.zeros((0,), np.int32) if accept_BxI is None else accept_BxI[b][accept_BxI[b] >= 0]
             for b in range(len(prompts))]
  return Generation(tokens, accepts)


@functools.partial(jax.jit, static_argnames=('structure', 'draft_depth'))
def looped_forward_split(structure: Structure, leaves, tokens_BxT, draft_depth: int):
  """`looped_forward` for a model split by `split(model, out_major=False)`."""
  model = structure.merge(leaves)
  b, t = tokens_BxT.shape
  pos_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask_BxTxS = attention_mask(pos_BxT)
  h_BxTxD, _ = model.trunk(tokens_BxT, pos_BxT, mask_BxTxS)
  logits_BxTxV, draft_logits = model.logits(h_BxTxD), []
  for j in range(1, draft_depth + 1):
    h_BxTxD, _ = model.mtp_head(head_for_depth(j, model.cfg.num_mtp_heads), h_BxTxD,
                                shift_left(tokens_BxT, j), pos_BxT, mask_BxTxS)
    draft_logits.append(model.logits(h_BxTxD))
  empty_0xBxTxV = jnp.zeros((0,) + logits_BxTxV.shape, logits_BxTxV.dtype)
  return logits_BxTxV, jnp.stack(draft_logits) if draft_logits else empty_0xBxTxV


def looped_forward(model: MTPTransformer, tokens_BxT, draft_depth: int):
  """Teacher-forced (logits_BxTxV, draft_logits_JxBxTxV) of the looped heads (see module doc).

  Depth j at position i runs head ((j-1) mod K)+1 on h^{j-1}_i and token i+j.
  """
  return looped_forward_split(*split(model, out_major=False), jnp.asarray(tokens_BxT, jnp.int32), draft_depth)
