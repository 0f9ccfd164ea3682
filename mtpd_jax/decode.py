"""KV-cache decoding: plain greedy/sampled generation and self-speculative decoding with the MTP heads.

Dimension letters: the legend in mtpd_jax/__init__.py.

Per sequence, `length` tokens are committed; the last one, at the *pending* position L = length-1,
is chosen but not yet run through the trunk, whose cache holds positions < L. Every call runs in
one jit per (batch shape, `DecodeOptions`); `generate` loops steps in a `lax.while_loop`. How a
speculative step drafts (chain, tree, adaptive depth, draft vocabulary) is the options'
`drafting.DraftPlan`; this file keeps the loop: state, commit, prefill, step, the jit wrappers.

Plain step: trunk(token L) -> main logits at L -> the next token is committed at L+1.

Speculative step (docs/design.md, "Metrics"), verify first then draft, so prefill ends with a draft pass too:
  1. Verify: one trunk call over the drafted nodes (the pending token, then the drafts: a chain's
     d_1..d_J at positions L..L+J, a tree's every node) gives the main logits after each.
     `verify.accept` accepts the longest prefix d_1..d_a of a path (greedy: equal to the main
     argmax; sampling: the lossless min(1, p/q) rule) and picks the next token (main argmax /
     residual sample / bonus). d_1..d_a and that token are committed (a+1 tokens per trunk call).
     Rejected positions roll back for free: the length does not advance over them, and the next
     verify rewrites their cache slots before any query can see them.
  2. Draft (`drafting.draft`): depth j = 1..J runs head ((j-1) mod K)+1 (training-free looping,
     MTP-D* of Table 8 — its own weights, but its own cache, since depth j's inputs differ from
     depth j-K's) at the last trunk position L-1, on h^{j-1} and the token L-1+j (the pending
     token for j = 1, then d_{j-1}); the depth-j logits there give d_j.

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

Adaptive depth (`DraftPlan.min_prob` > 0; docs/design.md, "Decoding cost"): a sequence proposes
the leading drafts whose head put at least `min_prob` on its most likely token, a choice made
before any draw, so sampling stays lossless; verification rejects the rest (sampled: with q = 0),
and the logits of a depth where no sequence of the batch still drafts are skipped.

Tree drafts (`DraftPlan.tree`; mtpd_jax/drafting.py): depth j runs once per node of depth j-1, on
that node's own earlier drafts, and one tree attention pass verifies every node. The state holds
one row per sequence plus the nodes (a chain is the tree (1, ..., 1)); paths exist only as index
tables, and the committed path's nodes are copied into place (`verify.keep_path`).

Context drafts (`DraftPlan.source`; `lookup.context_drafts`): prompt lookup copies what followed
the sequence's last n-gram earlier on; 'context' verifies that chain alone (no head runs, no MTP
heads needed), 'both' verifies it beside the heads' chain as path 1 of the tree (2, 1, ..., 1).

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

from mtpd_jax import drafting, sampling, verify
from mtpd_jax.drafting import DraftPlan
from mtpd_jax.model import Cache, ModelConfig, MTPTransformer, attention_mask, cache_mask, init_cache
from mtpd_jax.out_major import out_major_params, set_out_major
from mtpd_jax.shifts import gather_at, shift_left, write_at


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """Static decoding settings; one compilation per distinct value (and batch shape)."""
  max_new_tokens: int
  temperature: float = 0.0        # 0 = greedy
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  draft: DraftPlan = DraftPlan()  # how a speculative step drafts; DraftPlan() = plain decoding

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f'max_new_tokens={self.max_new_tokens} must be >= 1')
    object.__setattr__(self, 'temperature', float(self.temperature))
    object.__setattr__(self, 'top_p', float(self.top_p))
    object.__setattr__(self, 'stop_tokens', tuple(int(t) for t in self.stop_tokens))

  def plain(self) -> 'DecodeOptions':
    """The same decoding without speculation: what a speculative run is measured against."""
    return dataclasses.replace(self, draft=DraftPlan())


def options(max_new_tokens: int, *, draft_depth: int = 0, tree=(), draft_min_prob: float = 0.0, draft_vocab=None,
            draft_source: str = 'heads', ngram: int = 3, temperature: float = 0.0, top_p: float = 1.0,
            stop_tokens=()) -> DecodeOptions:
  """`DecodeOptions` from the flat keywords that `generate` takes (draft_vocab: token ids or None)."""
  plan = DraftPlan(draft_depth, tuple(tree), draft_min_prob,
                   () if draft_vocab is None or not draft_depth else drafting.vocab_ids(draft_vocab),
                   draft_source, ngram)
  return DecodeOptions(max_new_tokens, temperature, top_p, tuple(stop_tokens), plan)


class DecodeState(NamedTuple):
  """Everything a decoding step reads and writes, one row per sequence; the rest is speculative only."""
  tokens_BxS: jax.Array           # prompt, then the committed tokens
  length_B: jax.Array             # committed tokens (prompt included); the last is pending
  prompt_len_B: jax.Array
  done_B: jax.Array               # stop token or max_new_tokens reached
  step: jax.Array                 # decoding steps taken (prefill excluded)
  key: jax.Array
  caches: list[Cache]             # trunk, valid for positions < length-1
  logits_BxV: jax.Array           # main logits at length-2, from which the pending token was chosen
  accept_BxSteps: jax.Array | None = None   # accepted drafts at step i; -1 when not active
  h0_BxSxD: jax.Array | None = None         # trunk hidden states by position
  head_caches: list[Cache] | None = None    # one per draft depth (a row per node of depth j-1)
  nodes_BxNodes: jax.Array | None = None    # the pending token and the drafts (drafting.Tree)
  # Sampling only: the logits each node was drawn from.
  draft_logits_BxNodesxV: jax.Array | None = None
  # Adaptive depth, context drafts: whether each node is proposed.
  proposed_BxNodes: jax.Array | None = None


def cache_len(prompt_len: int, opts: DecodeOptions) -> int:
  """Cache slots: the padded prompt, max_new_tokens and one verify call's tokens (chain or tree)."""
  return prompt_len + opts.max_new_tokens + opts.draft.verified


def state_bytes(cfg: ModelConfig, batch: int, prompt_len: int, opts: DecodeOptions) -> int:
  """Bytes of the decoding state of `batch` prompts of `prompt_len` tokens (shapes only, nothing runs):
  what a decoding setting holds for its whole run, a tree's nodes and head caches included."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: MTPTransformer(cfg, rngs=nnx.Rngs(0))))
  prompt_BxT = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
  state = jax.eval_shape(lambda p, x, n: prefill(nnx.merge(graphdef, p), x, n, jax.random.key(0), opts),
                         params, prompt_BxT, jax.ShapeDtypeStruct((batch,), jnp.int32))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, 'dtype'))


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
  tokens_BxS = write_at(st.tokens_BxS, st.length_B[:, None] + idx_J1, emit_BxJ1, idx_J1 < n_B[:, None])
  length_B = st.length_B + n_B
  done_B = st.done_B | stopped_B | (length_B - st.prompt_len_B >= opts.max_new_tokens)
  return st._replace(tokens_BxS=tokens_BxS, length_B=length_B, done_B=done_B)


def _draft(model: MTPTransformer, st: DecodeState, start_B, width: int, key, opts: DecodeOptions, vocab):
  """`drafting.draft` of the state: the drafts after its pending token, and the head caches."""
  nodes_BxNodes, head_caches, draft_logits_BxNodesxV, proposed_BxNodes = drafting.draft(
      model, opts.draft, st.tokens_BxS, st.length_B, st.h0_BxSxD, st.head_caches, start_B, width, key, vocab,
      opts.temperature, opts.top_p)
  return st._replace(nodes_BxNodes=nodes_BxNodes, head_caches=head_caches,
                     draft_logits_BxNodesxV=draft_logits_BxNodesxV,
                     proposed_BxNodes=proposed_BxNodes)


def prefill(model: MTPTransformer, prompt_BxT, prompt_len_B, key, opts: DecodeOptions,
            vocab: drafting.DraftVocab | None = None) -> DecodeState:
  """Run the (right-padded) prompts, choose the first new token and, if speculative, the first drafts."""
  cfg, plan = model.cfg, opts.draft
  b, p = prompt_BxT.shape
  s = cache_len(p, opts)
  pos_BxT = jnp.broadcast_to(jnp.arange(p), (b, p))
  h_BxTxD, caches = model.trunk(prompt_BxT, pos_BxT, cache_mask(pos_BxT, s),
                                init_cache(cfg, b, s, cfg.num_layers))
  logits_BxV = model.logits(gather_at(h_BxTxD, prompt_len_B[:, None] - 1))[:, 0]
  key, key_first, key_draft = jax.random.split(key, 3)
  first_B = sampling.choose(key_first, logits_BxV, opts.temperature, opts.top_p)
  st = DecodeState(
      tokens_BxS=jnp.zeros((b, s), jnp.int32).at[:, :p].set(prompt_BxT), length_B=prompt_len_B,
      prompt_len_B=prompt_len_B, done_B=jnp.zeros((b,), bool), step=jnp.zeros((), jnp.int32),
      key=key, caches=caches, logits_BxV=logits_BxV)
  st = _commit(st, first_B[:, None], jnp.ones_like(prompt_len_B), opts)
  if not plan.depth:
    return st
  heads = plan.source != 'context'  # prompt lookup runs no head
  if heads and not cfg.num_mtp_heads:
    raise ValueError('speculative decoding needs a model with MTP heads (num_mtp_heads >= 1), '
                     "or draft_source='context'")
  st = st._replace(
      accept_BxSteps=jnp.full((b, opts.max_new_tokens), -1, jnp.int32),
      h0_BxSxD=jnp.zeros((b, s, cfg.dim), h_BxTxD.dtype).at[:, :p].set(h_BxTxD),
      head_caches=[init_cache(cfg, b * n, s, num_layers=1)[0]  # a row per node of depth j-1
                   for n in drafting.tree_of(plan).sizes[:-1]] if heads else [])
  return _draft(model, st, jnp.zeros_like(st.length_B), p, key_draft, opts, vocab)


def step(model: MTPTransformer, st: DecodeState, opts: DecodeOptions,
         vocab: drafting.DraftVocab | None = None) -> DecodeState:
  """One plain decoding step, or one speculative verify + draft step when the plan drafts."""
  plan = opts.draft
  j, s = plan.depth, st.tokens_BxS.shape[1]
  pos_BxJ1 = (st.length_B - 1)[:, None] + jnp.arange(j + 1)  # the pending token, then the committed path
  key, key_verify, key_draft = jax.random.split(st.key, 3)
  if j:  # one pass over the nodes (a chain's are its drafts); the sequence commits one path
    h_BxNodesxD, logits_BxNodesxV, caches = verify.verify_pass(
        model, st.nodes_BxNodes, st.length_B, st.caches, plan)
    path_B, accepted_B, next_B = verify.accept(
        key_verify, st.nodes_BxNodes, st.draft_logits_BxNodesxV, logits_BxNodesxV, plan,
        opts.temperature, opts.top_p, st.proposed_BxNodes)
    caches = verify.keep_path(caches, st.length_B, path_B, plan)
    on_path_BxJ1 = jnp.asarray(drafting.tree_of(plan).path_nodes)[path_B]
    tokens_BxJ1 = jnp.take_along_axis(st.nodes_BxNodes, on_path_BxJ1, axis=1)
  else:
    tokens_BxJ1 = gather_at(st.tokens_BxS, pos_BxJ1)
    h_BxNodesxD, caches = model.trunk(tokens_BxJ1, pos_BxJ1, cache_mask(pos_BxJ1, s), st.caches)
    logits_BxNodesxV, on_path_BxJ1 = model.logits(h_BxNodesxD), jnp.zeros_like(pos_BxJ1)
    accepted_B = jnp.zeros_like(st.length_B)
    next_B = sampling.choose(key_verify, logits_BxNodesxV[:, 0], opts.temperature, opts.top_p)
  # Emit d_1..d_a, then the main head's token at index a.
  idx_J1 = jnp.arange(j + 1)
  emit_BxJ1 = jnp.where(idx_J1 == accepted_B[:, None], next_B[:, None], jnp.roll(tokens_BxJ1, -1, axis=1))
  new = _commit(st, emit_BxJ1, accepted_B + 1, opts)
  emitted_B = new.length_B - st.length_B  # a+1, or fewer after a stop token or max_new_tokens
  # The node whose logits chose the pending token.
  last_B = jnp.take_along_axis(on_path_BxJ1, jnp.maximum(emitted_B - 1, 0)[:, None], axis=1)
  logits_BxV = jnp.take_along_axis(logits_BxNodesxV, last_B[..., None], axis=1)[:, 0]
  new = new._replace(step=st.step + 1, key=key, caches=caches,
                     logits_BxV=jnp.where(emitted_B[:, None] > 0, logits_BxV, st.logits_BxV))
  if not j:
    return new
  new = new._replace(
      h0_BxSxD=write_at(st.h0_BxSxD, pos_BxJ1,
                        jnp.take_along_axis(h_BxNodesxD, on_path_BxJ1[..., None], axis=1)),
      accept_BxSteps=st.accept_BxSteps.at[:, st.step].set(jnp.where(st.done_B, -1, accepted_B),
                                                          mode='drop'))
  return _draft(model, new, jnp.maximum(new.length_B - 1 - 2 * j, 0), 2 * j, key_draft, opts, vocab)


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
  """A model's graphdef and parameter treedef: one static jit argument, hashed once (not per call).
  `out_major`: the leaves hold the dense matrices out-major (`out_major.out_major_params`)."""
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
  fast orientation for a step's few rows (docs/design.md, "Decoding cost"; `out_major.dense`).
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


def _vocab(model: MTPTransformer, opts: DecodeOptions) -> drafting.DraftVocab | None:
  """The plan's draft vocabulary, its unembedding columns gathered once, before any step."""
  return drafting.draft_vocab(model, opts.draft.vocab) if opts.draft.vocab else None


@functools.partial(jax.jit, static_argnames=('structure', 'opts'))
def jit_prefill(structure: Structure, leaves, prompt_BxT, prompt_len_B, key,
                opts: DecodeOptions) -> DecodeState:
  """`prefill` under jit."""
  model = decoding_model(structure, leaves)
  return prefill(model, prompt_BxT, prompt_len_B, key, opts, _vocab(model, opts))


@functools.partial(jax.jit, static_argnames=('structure', 'opts'))
def jit_steps(structure: Structure, leaves, st: DecodeState, opts: DecodeOptions, num_steps,
              until_done) -> DecodeState:
  """`num_steps` steps (finished sequences ride along), or with `until_done` fewer once every
  sequence is done. Both are traced arguments: one compilation serves any count, with or without
  the stop (both are required: a default would be a second compilation)."""
  model = decoding_model(structure, leaves)
  vocab = _vocab(model, opts)
  first = st.step
  running = lambda s: (s.step - first < num_steps) & ~(until_done & jnp.all(s.done_B))
  return jax.lax.while_loop(running, lambda s: step(model, s, opts, vocab), st)


def generate_arrays(structure: Structure, leaves, prompt_BxT, prompt_len_B, key, opts: DecodeOptions):
  """Prefill, then steps until every sequence is done: (tokens_BxS, length_B, accept_BxSteps or
  None), on the device. Two programs, `jit_prefill` and `jit_steps`: the timed step loops of
  `evaluate.step_seconds` run the same two, so an evaluation compiles each setting's step once."""
  st = jit_prefill(structure, leaves, prompt_BxT, prompt_len_B, key, opts)
  st = jit_steps(structure, leaves, st, opts, opts.max_new_tokens, True)
  return st.tokens_BxS, st.length_B, st.accept_BxSteps


def pad_prompts(prompts, multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad token-id prompts to a shared length (rounded up to `multiple`, to reuse compilations)."""
  lens_B = np.array([len(p) for p in prompts], np.int32)
  if lens_B.min() < 1:
    raise ValueError('every prompt needs at least one token')
  p = -(-int(lens_B.max()) // multiple) * multiple
  prompt_BxT = np.zeros((len(prompts), p), np.int32)
  for i, tokens in enumerate(prompts):
    prompt_BxT[i, :len(tokens)] = tokens
  return prompt_BxT, lens_B


class Generation(NamedTuple):
  """What `generate` returns, per prompt."""
  tokens: list[np.ndarray]          # new tokens of each prompt (a final stop token included)
  accept_lengths: list[np.ndarray]  # accepted drafts at each speculative step; empty when plain


def generate(model: MTPTransformer, prompts, *, seed: int = 0, pad_multiple: int = 16, **kwargs) -> Generation:
  """Decode a batch of token-id prompts: plain when draft_depth == 0, else self-speculative.

  Keyword arguments: those of `options` (draft_depth above K loops the heads; draft_vocab: token
  ids that drafts are chosen from, e.g. `frequent_tokens`, None = the whole vocabulary), seed and
  pad_multiple. A caller that holds `DecodeOptions` (and decodes one model many times) calls
  `generate_split` instead.
  """
  return generate_split(*split(model), prompts, options(**kwargs), seed=seed, pad_multiple=pad_multiple)


def generate_split(structure: Structure, leaves, prompts, opts: DecodeOptions, *, seed: int = 0,
                   pad_multiple: int = 16) -> Generation:
  """`generate` for a model split once by `split(model)`, decoding as `opts` says."""
  opts.draft.check_vocab(structure.cfg.vocab_size)
  prompt_BxT, lens_B = pad_prompts(prompts, pad_multiple)
  tokens_BxS, length_B, accept_BxSteps = jax.device_get(
      generate_arrays(structure, leaves, prompt_BxT, lens_B, jax.random.key(seed), opts))
  tokens = [tokens_BxS[b, lens_B[b]:length_B[b]] for b in range(len(prompts))]
  accepts = [np.zeros((0,), np.int32) if accept_BxSteps is None
             else accept_BxSteps[b][accept_BxSteps[b] >= 0] for b in range(len(prompts))]
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
    h_BxTxD, _ = model.mtp_head(drafting.head_for_depth(j, model.cfg.num_mtp_heads), h_BxTxD,
                                shift_left(tokens_BxT, j), pos_BxT, mask_BxTxS)
    draft_logits.append(model.logits(h_BxTxD))
  empty_0xBxTxV = jnp.zeros((0,) + logits_BxTxV.shape, logits_BxTxV.dtype)
  return logits_BxTxV, jnp.stack(draft_logits) if draft_logits else empty_0xBxTxV


def looped_forward(model: MTPTransformer, tokens_BxT, draft_depth: int):
  """Teacher-forced (logits_BxTxV, draft_logits_JxBxTxV) of the looped heads (see module doc).

  Depth j at position i runs head ((j-1) mod K)+1 on h^{j-1}_i and token i+j.
  """
  return looped_forward_split(*split(model, out_major=False), jnp.asarray(tokens_BxT, jnp.int32), draft_depth)
