"""Decoding: KV cache = recomputation, speculative greedy = plain greedy, lossless speculative sampling,
online greedy acceptance = teacher-forced agreement chains."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

from benchmarks import tiny_heads
from mtpd_jax import decode, drafting, metrics, sampling, verify
from mtpd_jax.harness import evaluate
from mtpd_jax.model import ModelConfig, MTPTransformer, cache_mask
from mtpd_jax.shifts import write_at

CFG = ModelConfig(vocab_size=32, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                  mlp_dim=64, num_mtp_heads=2, max_seq_len=128)
MAX_NEW = 24
STOP = (0, 31)  # the synthetic stream's EOS, and a token its progressions pass every few steps


def _prompts():
  """Ragged prompts: two openings of held-out synthetic documents and two random ones (the heads
  accept less after those, so sequences of one batch accept different lengths)."""
  rows = tiny_heads.synthetic_tokens(CFG.vocab_size, 16, range(2), seed=7)
  rng = np.random.default_rng(0)
  return [rows[0, :3], rows[1, :9], rng.integers(1, 32, 14), rng.integers(1, 32, 6)]


@pytest.fixture(scope='module')
def trained():
  return tiny_heads.train_tiny(CFG, steps=200, batch_size=8, seq_len=32, lr=3e-3)


@pytest.fixture(scope='module')
def models(trained):
  return {'random': MTPTransformer(CFG, rngs=nnx.Rngs(1)), 'trained': trained}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
  logits = jnp.log(jnp.array([[0.15, 0.5, 0.05, 0.3]]))
  np.testing.assert_allclose(sampling.probs(logits, 1.0, 0.8), [[0, 0.625, 0, 0.375]], atol=1e-6)
  np.testing.assert_allclose(sampling.probs(logits, 1.0, 0.81), [[0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]],
                             atol=1e-6)
  np.testing.assert_allclose(sampling.probs(logits, 1.0, 0.01), [[0, 1, 0, 0]], atol=1e-6)


@pytest.mark.parametrize('depth,stop', [(1, ()), (2, ()), (3, STOP)])  # depth below, equal to, above K=2
def test_speculative_greedy_equals_plain_greedy(models, depth, stop):
  prompts = _prompts()
  for name, model in models.items():
    plain = decode.generate(model, prompts, max_new_tokens=MAX_NEW, stop_tokens=stop)
    spec = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=depth, stop_tokens=stop)
    for b, (want, got, accepts) in enumerate(zip(plain.tokens, spec.tokens, spec.accept_lengths)):
      np.testing.assert_array_equal(got, want, err_msg=f'{name} model, prompt {b}')
      # Prefill emits one token, each step a+1, the last step possibly cut by a stop or max_new_tokens.
      emitted = 1 + np.sum(accepts + 1)
      assert emitted - accepts[-1] - 1 < len(got) <= emitted, (name, b)
      if stop:
        assert len(got) == MAX_NEW or got[-1] in stop
        assert not np.isin(got[:-1], stop).any()
    if name == 'trained':
      assert np.mean(np.concatenate(spec.accept_lengths)) > 0.5  # the heads do accept
      steps = min(map(len, spec.accept_lengths))
      firsts = np.stack([a[:steps] for a in spec.accept_lengths])
      if depth > 1:  # sequences accept different lengths in one step
        assert np.any(firsts.min(0) != firsts.max(0))
      if stop:
        assert min(map(len, plain.tokens)) < MAX_NEW  # and some finish early


@functools.partial(jax.jit, static_argnames=('structure', 'opts', 'num_steps'))
def _decode_trace(structure, leaves, prompt_BxT, prompt_len_B, opts, num_steps):
  """Prefill and `num_steps` steps; the buffers and logits after each of them, stacked."""
  model = structure.merge(leaves)
  st = decode.prefill(model, prompt_BxT, prompt_len_B, jax.random.key(0), opts)
  def body(st, _):
    # The committed tokens, then (speculative) the chain's drafts after the pending token.
    buffer_BxS = st.tokens_BxS if st.nodes_BxNodes is None else write_at(
        st.tokens_BxS, (st.length_B - 1)[:, None] + jnp.arange(st.nodes_BxNodes.shape[1]), st.nodes_BxNodes)
    # The root was drawn from no draft logits.
    draft_logits = None if st.draft_logits_BxNodesxV is None else st.draft_logits_BxNodesxV[:, 1:]
    return decode.step(model, st, opts), (buffer_BxS, st.length_B, st.logits_BxV, draft_logits)
  st, trace = jax.lax.scan(body, st, length=num_steps)
  return trace, st.accept_BxSteps


@pytest.mark.parametrize('depth', [0, 1, 2, 3])  # plain, below K=2 (every K=1 row drafts at 1), K, looped
def test_kv_cache_decoding_matches_full_recomputation(trained, depth):
  """Main and draft logits of every step equal the teacher-forced looped forward (f32, 1e-4).

  Speculative decoding samples here (temperature 1), since only sampling keeps the draft logits.
  Every depth 1..K+1: the head caches' refresh window is 2J positions, and a window one short
  misses slots only at J = 1.
  """
  opts = decode.options(12, draft_depth=depth, temperature=1.0 if depth else 0.0)
  prompt_BxT, lens_B = decode.pad_prompts(_prompts(), 16)
  trace, accepts_BxSteps = _decode_trace(*decode.split(trained), prompt_BxT, lens_B, opts, 5)
  rows = np.arange(len(lens_B))
  for tokens_BxS, length_B, logits_BxV, draft_logits_BxJxV in zip(*map(np.asarray, trace[:3]),
                                                                  trace[3] if depth else [None] * 5):
    # The buffer holds committed tokens, then the drafts: position length-2 is the last trunk position.
    full_BxSxV, full_drafts_JxBxSxV = decode.looped_forward(trained, tokens_BxS, depth)
    last_B = length_B - 2
    np.testing.assert_allclose(logits_BxV, full_BxSxV[rows, last_B], atol=1e-4, rtol=1e-4)
    if depth:
      full_BxJxV = np.swapaxes(full_drafts_JxBxSxV[:, rows, last_B], 0, 1)
      np.testing.assert_allclose(draft_logits_BxJxV, full_BxJxV, atol=1e-4, rtol=1e-4)
  if depth:  # accepted and rolled-back drafts were both seen, and (J > 1) some sequence finished early
    seen = set(np.asarray(accepts_BxSteps)[:, :5].ravel().tolist())
    assert 0 in seen and max(seen) > 0 and (depth == 1 or -1 in seen)


@pytest.mark.parametrize('depth', [1, 2, 3])  # depth 3 runs head 1 again (looped)
def test_online_greedy_acceptance_equals_teacher_forced_chains(trained, depth):
  """Each online step's accepted length = the teacher-forced chain at its last trunk position."""
  prompts = _prompts()
  spec = decode.generate(trained, prompts, max_new_tokens=MAX_NEW, draft_depth=depth, stop_tokens=STOP)
  greedy = decode.generate(trained, prompts, max_new_tokens=MAX_NEW)  # past the stop tokens
  tokens_BxT, _ = decode.pad_prompts([np.concatenate([p, t]) for p, t in zip(prompts, greedy.tokens)], 16)
  valid_BxT = np.arange(tokens_BxT.shape[1]) < np.array([len(p) + MAX_NEW for p in prompts])[:, None]
  logits_BxTxV, draft_logits_JxBxTxV = decode.looped_forward(trained, tokens_BxT, depth)
  chains_BxT = metrics.teacher_forced_accept_lengths(np.argmax(logits_BxTxV, -1), np.argmax(draft_logits_JxBxTxV, -1),
                                                     valid_BxT)
  online, offline = [], []
  for b, (prompt, accepts) in enumerate(zip(prompts, spec.accept_lengths)):
    starts = len(prompt) - 1 + np.concatenate([[0], np.cumsum(accepts[:-1] + 1)])
    fits = chains_BxT[b, starts] >= 0  # the chain's tokens lie inside the greedy continuation
    assert fits[:-1].all() or fits.sum() >= len(fits) - 2
    online.extend(accepts[fits])
    offline.extend(chains_BxT[b, starts[fits]])
  np.testing.assert_array_equal(offline, online)
  assert metrics.acceptance_stats(offline, depth) == metrics.acceptance_stats(online, depth)
  assert len(online) > 20 and 0 < np.mean(online) < depth


# Lossless speculative sampling: a tiny vocabulary, so the joint law of three tokens has 512 cells.
CFG8 = ModelConfig(vocab_size=8, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                   mlp_dim=32, num_mtp_heads=2)
TEMPERATURE, TOP_P, SAMPLES = 1.0, 0.9, 16384
BROKEN_RULES = {
    'always_accept': lambda u, p, q: jnp.ones_like(u, bool),
    'min_1_q_over_p': lambda u, p, q: u * p < q,
}


def _plain_sampling_law(model, prompt):
  """P(t1, t2, t3) of plain sampling, enumerated: one forward over prompt + every (t1, t2)."""
  v = CFG8.vocab_size
  pairs = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing='ij'), -1).reshape(-1, 2)
  logits = decode.looped_forward(model, np.concatenate([np.tile(prompt, (v * v, 1)), pairs], axis=1), 0)[0]
  p = np.asarray(sampling.probs(logits[:, len(prompt) - 1:], TEMPERATURE, TOP_P), np.float64)
  p1, p2, p3 = p[0, 0], p[::v, 1], p[:, 2].reshape(v, v, v)  # rows are t1 * v + t2
  return p1[:, None, None] * p2[:, :, None] * p3


def _chi_square(model, prompt, law, samples=SAMPLES, **kwargs):
  """(p-value of the samples under `law`, samples that `law` calls impossible)."""
  out = decode.generate(model, [prompt] * samples, max_new_tokens=3, temperature=TEMPERATURE, top_p=TOP_P,
                        **kwargs)
  counts = np.bincount(np.ravel_multi_index(np.stack(out.tokens).T, law.shape), minlength=law.size)
  expected = law.ravel() * samples
  big = expected >= 5  # pool the sparse (and the impossible) cells into one
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  return scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue, counts[expected == 0].sum()


def _chi_square_with(monkeypatch, patch, model, prompt, law, **kwargs):
  """`_chi_square` with `patch` = (module, name, broken rule) in place while decoding (None: none)."""
  if patch is not None:
    monkeypatch.setattr(*patch)
  jax.clear_caches()  # the rule is traced into the compiled decoder
  try:
    return _chi_square(model, prompt, law, **kwargs)
  finally:
    monkeypatch.undo()
    jax.clear_caches()


@pytest.fixture(scope='module')
def sampling_setup():
  model = MTPTransformer(CFG8, rngs=nnx.Rngs(3))
  prompt = np.array([1, 5, 2, 7], np.int32)
  return model, prompt, _plain_sampling_law(model, prompt)


def test_plain_sampling_matches_the_enumerated_law(sampling_setup):
  model, prompt, law = sampling_setup
  pvalue, impossible = _chi_square(model, prompt, law, seed=0)
  assert pvalue > 1e-3 and impossible == 0


@pytest.mark.parametrize('rule', [None, *BROKEN_RULES])
def test_speculative_sampling_is_lossless_and_catches_wrong_rules(sampling_setup, rule, monkeypatch):
  model, prompt, law = sampling_setup
  patch = None if rule is None else (sampling, 'accept_draft', BROKEN_RULES[rule])
  pvalue, impossible = _chi_square_with(monkeypatch, patch, model, prompt, law, draft_depth=2, seed=1)
  if rule is None:
    assert pvalue > 1e-3 and impossible == 0  # tokens outside the top-p nucleus never appear
  else:
    assert pvalue < 1e-6, f'the chi-square test misses the wrong acceptance rule {rule}'


def test_draft_vocabulary_keeps_greedy_output_and_is_checked(models):
  """Drafts from a subset of the vocabulary (frequent ids, or ids the drafts never need) change
  what is accepted, never what is emitted; bad ids are refused."""
  prompts = _prompts()
  rows = tiny_heads.synthetic_tokens(CFG.vocab_size, 32, range(64), seed=11)
  for name, model in models.items():
    plain = decode.generate(model, prompts, max_new_tokens=MAX_NEW, stop_tokens=STOP)
    for ids in (evaluate.frequent_tokens(rows, 12), np.arange(0, CFG.vocab_size, 3)):
      spec = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=3, stop_tokens=STOP,
                             draft_vocab=ids)
      for want, got in zip(plain.tokens, spec.tokens):
        np.testing.assert_array_equal(got, want, err_msg=name)
  for bad in ([], [0, 0], [-1], [CFG.vocab_size], [[1, 2]], [0.5]):
    with pytest.raises(ValueError, match='draft vocabulary'):
      decode.generate(models['random'], prompts, max_new_tokens=2, draft_depth=1, draft_vocab=np.asarray(bad))


def _drafted_ids(structure, leaves, prompts, opts, num_steps=MAX_NEW):
  """Every token id that greedy drafting proposes to unfinished sequences (any path) in `num_steps` steps."""
  prompt_BxT, lens_B = decode.pad_prompts(prompts)
  st = decode.jit_prefill(structure, leaves, prompt_BxT, lens_B, jax.random.key(0), opts)
  ids = set()
  for _ in range(num_steps):
    nodes_BxNodes, done_B = map(np.asarray, (st.nodes_BxNodes, st.done_B))
    for nodes_Nodes, done in zip(nodes_BxNodes, done_B):
      ids.update([] if done else nodes_Nodes[1:].tolist())  # node 0 is the pending token
    st = decode.jit_steps(structure, leaves, st, opts, 1, False)
  return ids


@pytest.mark.parametrize('tree', [(), (2, 1)])
def test_a_draft_vocabulary_holding_every_drafted_id_accepts_exactly_as_the_full_vocabulary(trained, tree):
  """Drafts over U ids are the full-vocabulary drafts whenever U holds them: the argmax (or top b_j)
  among U is then the one over V, so every step accepts the same length. The ids come in a shuffled
  order, so a draft index mapped to the wrong id (or read as an id) changes what is accepted, which
  no losslessness test can see."""
  structure, leaves = decode.split(trained)
  kwargs = dict(max_new_tokens=MAX_NEW, draft_depth=3 if not tree else len(tree), stop_tokens=STOP, tree=tree)
  ids = _drafted_ids(structure, leaves, _prompts(), decode.options(**kwargs))
  assert 3 <= len(ids) < CFG.vocab_size, ids  # a real subset
  vocab = np.random.default_rng(0).permutation(sorted(ids))
  full = decode.generate_split(structure, leaves, _prompts(), decode.options(**kwargs))
  sub = decode.generate_split(structure, leaves, _prompts(), decode.options(draft_vocab=vocab, **kwargs))
  for want, got in zip(full.accept_lengths, sub.accept_lengths):
    np.testing.assert_array_equal(got, want)
  assert np.concatenate(full.accept_lengths).sum() > 10


def test_both_matrix_layouts_decode_the_same_greedy_tokens(trained):
  """`decode.split(out_major=...)`: the CPU default (W @ x^T) and the training layout (x @ W) give
  the same greedy output, plain and as a tree deeper than K over a draft vocabulary."""
  layouts = {om: decode.split(trained, out_major=om) for om in (True, False)}
  assert layouts[True][0] != layouts[False][0]
  assert decode.split(trained)[0].out_major == (jax.default_backend() == 'cpu')
  for kwargs in ({}, {'draft_depth': 3, 'draft_vocab': np.arange(8, 30), 'tree': (2, 1, 1)}):
    outs = {om: decode.generate_split(*split, _prompts(), decode.options(MAX_NEW, **kwargs))
            for om, split in layouts.items()}
    for got, want in zip(outs[True].tokens, outs[False].tokens):
      np.testing.assert_array_equal(got, want, err_msg=str(kwargs))
    for got, want in zip(outs[True].accept_lengths, outs[False].accept_lengths):
      np.testing.assert_array_equal(got, want, err_msg=str(kwargs))


def test_frequent_tokens_ranks_by_count_and_returns_ascending_ids():
  tokens = np.array([5, 5, 5, 2, 2, 9, 9, 9, 9, 1])
  np.testing.assert_array_equal(evaluate.frequent_tokens(tokens, 2), [5, 9])
  np.testing.assert_array_equal(evaluate.frequent_tokens(tokens, 3), [2, 5, 9])  # 2 beats 1 on count


@pytest.mark.slow
def test_bfloat16_speculative_greedy_equals_bfloat16_plain_greedy(trained):
  """bf16 decoding (matrices cast once) is its own model: speculation stays lossless against it."""
  model16 = MTPTransformer(dataclasses.replace(CFG, dtype='bfloat16'), rngs=nnx.Rngs(0))
  nnx.update(model16, nnx.state(trained, nnx.Param))
  prompts = _prompts()
  plain = decode.generate(model16, prompts, max_new_tokens=MAX_NEW)
  for vocab in (None, np.arange(CFG.vocab_size // 2)):
    spec = decode.generate(model16, prompts, max_new_tokens=MAX_NEW, draft_depth=2, draft_vocab=vocab)
    for want, got in zip(plain.tokens, spec.tokens):
      np.testing.assert_array_equal(got, want)
  assert np.mean(np.concatenate(spec.accept_lengths)) > 0.2


def test_speculative_sampling_with_a_draft_vocabulary_is_lossless(sampling_setup):
  """q lives on half the vocabulary (0 elsewhere); the output law is still plain sampling's."""
  model, prompt, law = sampling_setup
  pvalue, impossible = _chi_square(model, prompt, law, draft_depth=2, seed=2,
                                   draft_vocab=np.array([0, 2, 3, 6]))
  assert pvalue > 1e-3 and impossible == 0


def test_adaptive_depth_keeps_greedy_output_and_proposes_the_confident_prefix(models):
  """draft_min_prob cuts each sequence's chain at its first depth whose head's top probability is
  below it; what is emitted never changes, including drafts looped past K."""
  prompts = _prompts()
  for name, model in models.items():
    plain = decode.generate(model, prompts, max_new_tokens=MAX_NEW, stop_tokens=STOP)
    chain = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=3, stop_tokens=STOP)
    for min_prob in (0.5, 0.9, 1.0):
      spec = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=3, stop_tokens=STOP,
                             draft_min_prob=min_prob)
      for want, got in zip(plain.tokens, spec.tokens):
        np.testing.assert_array_equal(got, want, err_msg=f'{name}, draft_min_prob={min_prob}')
    if name == 'trained':  # the cut drafts were ones the chain would have had accepted, some of them
      assert np.concatenate(spec.accept_lengths).sum() < np.concatenate(chain.accept_lengths).sum()
  # The count of proposed drafts: the leading depths whose top probability reaches the threshold.
  structure, leaves = decode.split(models['trained'])
  prompt_BxT, lens_B = decode.pad_prompts(prompts)
  opts = decode.options(MAX_NEW, draft_depth=3, temperature=1.0, draft_min_prob=0.6)
  st = decode.jit_steps(structure, leaves, decode.jit_prefill(structure, leaves, prompt_BxT, lens_B,
                                                              jax.random.key(0), opts), opts, 2, False)
  # A chain's drafts: its nodes past the root.
  top_BxJ = np.asarray(jnp.max(sampling.probs(st.draft_logits_BxNodesxV[:, 1:], 1.0), axis=-1))
  proposed_B = np.asarray(st.proposed_BxNodes[:, 1:]).sum(1)
  np.testing.assert_array_equal(proposed_B, np.cumprod(top_BxJ >= 0.6, axis=1).sum(1))
  assert 0 < proposed_B.min() < 3 or 0 < proposed_B.max() < 3
  with pytest.raises(ValueError, match='draft_min_prob=1.5'):
    decode.generate(models['random'], prompts, max_new_tokens=2, draft_depth=1, draft_min_prob=1.5)


@functools.partial(jax.jit, static_argnames=('structure', 'opts', 'num_steps'))
def _proposed_and_accepted(structure, leaves, prompt_BxT, prompt_len_B, opts, num_steps):
  """Per step, the drafts each sequence proposed (adaptive depth) and how many were accepted."""
  model = structure.merge(leaves)
  st = decode.prefill(model, prompt_BxT, prompt_len_B, jax.random.key(0), opts)
  depth = opts.draft.depth
  st, proposed_StepsxB = jax.lax.scan(lambda st, _: (decode.step(model, st, opts), jnp.sum(st.proposed_BxNodes[:, 1:depth + 1], 1)),
                                  st, length=num_steps)
  return proposed_StepsxB.T, st.accept_BxSteps[:, :num_steps]


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_adaptive_depth_never_accepts_a_draft_it_did_not_propose(trained, temperature):
  """AR, CAR and tokens per forward count an unproposed draft as rejected (docs/design.md,
  "Metrics"), even where it happens to match: accepted <= proposed at every step, and at
  draft_min_prob = 1.0 (nothing proposed) every accepted length is 0, though the chain accepts."""
  prompt_BxT, lens_B = decode.pad_prompts(_prompts())
  structure, leaves = decode.split(trained)
  steps = {}
  for min_prob in (0.0, 0.6, 1.0):
    opts = decode.options(MAX_NEW, draft_depth=3, temperature=temperature, draft_min_prob=min_prob)
    if min_prob:
      proposed_BxSteps, accepted_BxSteps = map(np.asarray, _proposed_and_accepted(structure, leaves, prompt_BxT, lens_B,
                                                                           opts, 8))
      live_BxSteps = accepted_BxSteps >= 0
      assert (accepted_BxSteps[live_BxSteps] <= proposed_BxSteps[live_BxSteps]).all(), min_prob
      steps[min_prob] = proposed_BxSteps[live_BxSteps], accepted_BxSteps[live_BxSteps]
    else:
      st = decode.jit_prefill(structure, leaves, prompt_BxT, lens_B, jax.random.key(0), opts)
      accepted_BxSteps = np.asarray(decode.jit_steps(structure, leaves, st, opts, 8, False).accept_BxSteps[:, :8])
      steps[min_prob] = None, accepted_BxSteps[accepted_BxSteps >= 0]
  assert (steps[1.0][0] == 0).all() and (steps[1.0][1] == 0).all()
  assert steps[0.0][1].sum() > 0  # the heads' drafts do match: without the rule some would count
  proposed, accepted = steps[0.6]
  assert (proposed < 3).any() and (accepted == proposed).any() and (accepted < proposed).any()


def _drawn_draft_probability(logits_BxV, drafts_BxChildren, temperature, top_p):  # a broken rule: it reads the draw
  p_BxV = sampling.probs(logits_BxV, temperature or 1.0, top_p)
  return jnp.take_along_axis(p_BxV, drafts_BxChildren[:, :1], axis=-1)[:, 0]


@pytest.mark.parametrize('broken', [False, True])
def test_speculative_sampling_with_adaptive_depth_is_lossless_and_catches_a_draw_dependent_cut(
    sampling_setup, broken, monkeypatch):
  """Drafts past the confident prefix are not proposed: the token after them comes from p itself.
  Cutting on the drawn draft's own probability instead biases the output, and the test sees it."""
  model, prompt, law = sampling_setup
  patch = (drafting, 'draft_confidence', _drawn_draft_probability) if broken else None
  pvalue, impossible = _chi_square_with(monkeypatch, patch, model, prompt, law, draft_depth=2, seed=3,
                                        draft_min_prob=0.4)
  if broken:
    assert pvalue < 1e-6, 'the chi-square test misses a draw-dependent cut'
  else:
    assert pvalue > 1e-3 and impossible == 0


def _no_residual(p_BxV, q_BxV):  # a broken rule: every sibling is tested against the full p
  del q_BxV
  return p_BxV


@pytest.mark.parametrize('tree, kwargs, broken', [
    ((3, 2), {}, False), ((3, 2), dict(samples=4096), True),  # the broken rule: p < 1e-200 even at 4096 samples
    ((2, 1), dict(draft_min_prob=0.4, draft_vocab=np.array([0, 2, 3, 5, 6])), False)])
def test_sampled_tree_is_lossless_and_catches_siblings_tested_without_the_residual(
    sampling_setup, tree, kwargs, broken, monkeypatch):
  """Recursive rejection sampling over siblings (`verify.accept`) keeps plain sampling's law,
  with adaptive depth and a draft vocabulary too; testing each sibling against the full p instead
  of the residual that its elder siblings' rejections leave biases the output, and the test sees it."""
  model, prompt, law = sampling_setup
  patch = (sampling, 'residual', _no_residual) if broken else None
  pvalue, impossible = _chi_square_with(monkeypatch, patch, model, prompt, law, draft_depth=len(tree), seed=4,
                                        tree=tree, **kwargs)
  if broken:
    assert pvalue < 1e-6, 'the chi-square test misses siblings tested without the residual'
  else:
    assert pvalue > 1e-3 and impossible == 0


def test_sampled_tree_siblings_are_independent_draws_from_their_parents_q(sampling_setup):
  """A node's children are b_j independent draws from the q its head gives (each child carries
  that q): two siblings agree as often as sum(q^2) says, and the children of different parents
  read their own parents' q."""
  model, prompt, _ = sampling_setup
  tree = (3, 2)
  opts = decode.options(3, draft_depth=2, temperature=TEMPERATURE, top_p=TOP_P, tree=tree)
  structure, leaves = decode.split(model)
  st = decode.jit_prefill(structure, leaves, *decode.pad_prompts([prompt] * 2048), jax.random.key(5), opts)
  nodes_BxNodes = np.asarray(st.nodes_BxNodes)
  q_BxNodesxV = np.asarray(sampling.probs(st.draft_logits_BxNodesxV, TEMPERATURE, TOP_P))
  assert nodes_BxNodes.shape[1] == 10  # the root, 3 nodes at depth 1, 6 at depth 2
  # Siblings carry their parent's one q.
  np.testing.assert_array_equal(q_BxNodesxV[:, 1], q_BxNodesxV[:, 3])
  # P(two independent draws from the root's q agree).
  agree = np.mean(np.sum(q_BxNodesxV[:, 1] ** 2, axis=-1))
  same = np.mean(nodes_BxNodes[:, 1] == nodes_BxNodes[:, 3])  # nodes 1 and 3: siblings at depth 1
  assert abs(same - agree) < 0.04 and agree < 0.8  # 2048 pairs: 4 standard errors
  # Node 1's children (4, 5) and node 2's (6, 7) come from different q's: their laws differ.
  assert np.abs(q_BxNodesxV[:, 4] - q_BxNodesxV[:, 6]).max() > 0.05
  for child in (4, 5, 6, 7):  # each child is drawn from its parent's q: the empirical law matches it
    freq_V = np.bincount(nodes_BxNodes[:, child], minlength=8) / len(nodes_BxNodes)
    np.testing.assert_allclose(freq_V, q_BxNodesxV[:, child].mean(0), atol=0.05)


def test_sampled_siblings_raise_the_acceptance_length(trained):
  """At temperature 1, a second and third sibling give the walk more chances than the chain's one
  draft: a (3, 2) tree accepts 1.06 drafts per step against the chain's 0.86 (seeded)."""
  lengths = {}
  for tree in ((), (3, 2)):
    out = decode.generate(trained, _prompts() * 8, max_new_tokens=48, draft_depth=2, temperature=1.0, seed=1,
                          tree=tree)
    lengths[tree] = np.mean(np.concatenate(out.accept_lengths))
  assert lengths[(3, 2)] > lengths[()] + 0.1, lengths


@pytest.mark.parametrize('tree', [(2,), (3, 2), (2, 1, 2)])  # one depth, two, and three (past K=2: looped)
def test_tree_greedy_equals_plain_greedy_and_accepts_at_least_the_chain(models, tree):
  """Every path of the tree is verified as a chain and the longest accepted one is kept: the output
  is plain greedy's, token for token, and a step accepts at least what the chain (path 0) would."""
  prompts = _prompts()
  for name, model in models.items():
    plain = decode.generate(model, prompts, max_new_tokens=MAX_NEW, stop_tokens=STOP)
    chain = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=len(tree), stop_tokens=STOP)
    spec = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=len(tree), stop_tokens=STOP,
                           tree=tree)
    for b, (want, got) in enumerate(zip(plain.tokens, spec.tokens)):
      np.testing.assert_array_equal(got, want, err_msg=f'{name} model, tree {tree}, prompt {b}')
    # Path 0 is the chain, so from the same state (after prefill) the tree accepts at least as much.
    assert all(t[0] >= c[0] for t, c in zip(spec.accept_lengths, chain.accept_lengths)), name
    if name == 'trained':  # and over the whole run, more per step (0.61 -> 0.93 for (2,), 1.07 -> 2.0 for (2, 1, 2))
      assert np.mean(np.concatenate(spec.accept_lengths)) > np.mean(np.concatenate(chain.accept_lengths)) + 0.2


def test_a_tree_that_cannot_run_is_refused_in_one_line(models):
  for kwargs, message in ((dict(draft_depth=2, tree=(2,)), 'for each of the draft_depth=2 depths'),
                          (dict(draft_depth=1, tree=(0,)), 'branching >= 1')):
    with pytest.raises(ValueError, match=message):
      decode.generate(models['random'], _prompts(), max_new_tokens=2, **kwargs)


def test_tree_caches_hold_exactly_the_committed_tokens_states(trained):
  """After tree steps, the trunk cache holds at each committed position the keys and values that a
  teacher-forced pass over the committed tokens gives, and the hidden states those positions' own:
  the accepted path was compacted into place, as a chain has it."""
  structure, leaves = decode.split(trained)
  prompt_BxT, lens_B = decode.pad_prompts(_prompts(), 16)
  opts = decode.options(MAX_NEW, draft_depth=3, tree=(3, 1, 2))
  st = decode.jit_steps(structure, leaves, decode.jit_prefill(structure, leaves, prompt_BxT, lens_B,
                                                              jax.random.key(0), opts), opts, 4, False)
  tokens_BxS, length_B = np.asarray(st.tokens_BxS), np.asarray(st.length_B)
  # one row per sequence, holding the root and the 3 + 3 + 6 drafts
  assert st.nodes_BxNodes.shape == (len(lens_B), 13) and st.h0_BxSxD.shape[0] == len(lens_B)
  ref = decode.jit_prefill(structure, leaves, tokens_BxS[:, :length_B.max()], length_B,  # a chain prefill: keeps h
                           jax.random.key(0), decode.options(1, draft_depth=1))
  for b, length in enumerate(length_B):
    n = length - 1  # the trunk has run positions < the pending one
    np.testing.assert_allclose(st.h0_BxSxD[b, :n], ref.h0_BxSxD[b, :n], atol=1e-4, rtol=1e-4)
    for got, want in zip(st.caches, ref.caches):
      for name in ('k', 'v'):
        np.testing.assert_allclose(got[name][b, :, :n], want[name][b, :, :n], atol=1e-4, rtol=1e-4)
  assert (length_B >= lens_B + 5).all()  # prefill and 4 steps each emitted


@pytest.mark.parametrize('tree', [(2,), (3, 1, 2)])
def test_the_tree_pass_gives_each_path_what_a_chain_verify_of_its_drafts_gives(models, tree):
  """The tree attention mask lets a node see the committed prefix and exactly its ancestors: each
  path's main logits and hidden states from the one tree pass equal those of a chain verify call
  over that path's pending token and drafts."""
  model = models['trained']
  structure, leaves = decode.split(model)
  prompt_BxT, lens_B = decode.pad_prompts(_prompts(), 16)
  opts = decode.options(MAX_NEW, draft_depth=len(tree), tree=tree)
  st = decode.jit_steps(structure, leaves, decode.jit_prefill(structure, leaves, prompt_BxT, lens_B,
                                                              jax.random.key(0), opts), opts, 2, False)
  h_BxNodesxD, logits_BxNodesxV, _ = verify.verify_pass(model, st.nodes_BxNodes, st.length_B,
                                                          st.caches, opts.draft)
  nodes_PathsxJ1 = drafting.path_nodes(tree)
  # The paths do differ.
  assert len(np.unique(np.asarray(st.nodes_BxNodes)[:, nodes_PathsxJ1], axis=1)[0]) > 1
  pos_BxJ1 = (st.length_B - 1)[:, None] + jnp.arange(len(tree) + 1)
  for path in nodes_PathsxJ1:
    tokens_BxJ1 = st.nodes_BxNodes[:, path]
    h_want, _ = model.trunk(tokens_BxJ1, pos_BxJ1, cache_mask(pos_BxJ1, st.tokens_BxS.shape[1]), st.caches)
    np.testing.assert_allclose(h_BxNodesxD[:, path], h_want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits_BxNodesxV[:, path], model.logits(h_want), atol=1e-4, rtol=1e-4)
