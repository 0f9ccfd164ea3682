"""Drafts from the context (prompt lookup): the lookup, online acceptance against a replay of plain
greedy decoding, and lossless sampling, alone (`draft_source='context'`) and beside the heads'
chain as one tree (`'both'`)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import tiny_heads
from mtpd_jax import decode, drafting, lookup, metrics
from mtpd_jax.model import MTPTransformer
from tests.decode_test import CFG, MAX_NEW, _chi_square_with, sampling_setup  # noqa: F401 (a fixture)


def _lookup(seq, depth, ngram):
  """The reference lookup: what followed the longest suffix n-gram's latest occurrence that `depth`
  tokens follow, else its latest; [] when no suffix n-gram occurs earlier."""
  last = len(seq) - 1  # the pending token
  for n in range(ngram, 0, -1):
    ends = [e for e in range(n - 1, last) if n - 1 <= last and list(seq[e - n + 1:e + 1]) == list(seq[last - n + 1:])]
    if ends:
      followed = [e for e in ends if e + depth <= last]
      end = max(followed or ends)
      return [seq[end + j] for j in range(1, depth + 1) if end + j <= last]
  return []


def test_context_drafts_copy_what_followed_the_longest_latest_match():
  rows = [[5, 6, 7, 8, 5, 6, 9, 9, 9, 9],   # L=5: '5 6' ends at 1 -> 7 8 5
          [1, 2, 3, 1, 2, 4, 2, 0, 0, 0],   # L=6: '4 2' never, '2' ends at 4 (3 tokens follow? no: 5, 6) and at 1
          [3, 3, 3, 3, 3, 3, 0, 0, 0, 0],   # L=5: '3 3 3' ends at 2..4; 2 is the latest that 3 tokens follow
          [7, 1, 2, 0, 0, 0, 0, 0, 0, 0],   # L=2: no earlier n-gram
          [4, 4, 0, 0, 0, 0, 0, 0, 0, 0]]   # L=1: '4' ends at 0, one committed token follows
  length = np.array([6, 7, 6, 3, 2])
  drafts, found = map(np.asarray, lookup.context_drafts(np.array(rows), length, 3, 2))
  np.testing.assert_array_equal(found, [[1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0]])
  np.testing.assert_array_equal(np.where(found, drafts, -1), [[7, 8, 5], [3, 1, 2], [3, 3, 3], [-1] * 3, [4, -1, -1]])
  for row, n, d, f in zip(rows, length, drafts, found):
    assert list(d[f]) == _lookup(row[:n], 3, 2)
  rng = np.random.default_rng(0)  # and random rows against the reference
  rows = rng.integers(0, 4, (64, 20))
  length = rng.integers(1, 21, 64)
  for depth, ngram in ((1, 1), (4, 3)):
    drafts, found = map(np.asarray, lookup.context_drafts(rows, length, depth, ngram))
    for row, n, d, f in zip(rows, length, drafts, found):
      assert list(d[f]) == _lookup(row[:n], depth, ngram) and (np.cumprod(f) == f).all()


@pytest.fixture(scope='module')
def trained():
  return tiny_heads.train_tiny(CFG, steps=200, batch_size=8, seq_len=32, lr=3e-3)


def _prompts():
  rows = tiny_heads.synthetic_tokens(CFG.vocab_size, 16, range(2), seed=7)
  rng = np.random.default_rng(1)  # a repeating prompt too, which lookup copies from
  return [rows[0, :5], rows[1, :12], np.tile(rng.integers(1, 32, 4), 4), rng.integers(1, 32, 7)]


@pytest.fixture(scope='module')
def models(trained):
  """The trained model, and an untrained one whose greedy output falls into loops that lookup copies."""
  return {'trained': trained, 'looping': MTPTransformer(CFG, rngs=nnx.Rngs(3))}


def _replay(model, prompts, source, depth, ngram):
  """Plain greedy's continuation of each prompt; per prompt, the accept lengths a replay of it gives
  (the reference lookup's drafts, and for 'both' the heads' teacher-forced chain, the longer path,
  matched against it); and how many steps the context path won outright."""
  greedy = decode.generate(model, prompts, max_new_tokens=MAX_NEW + 2 * depth + 2)
  seqs = [np.concatenate([p, t]) for p, t in zip(prompts, greedy.tokens)]
  tokens_BxT, _ = decode.pad_prompts(seqs, 16)
  valid_BxT = np.arange(tokens_BxT.shape[1]) < np.array(list(map(len, seqs)))[:, None]
  logits_BxTxV, draft_logits_JxBxTxV = decode.looped_forward(model, tokens_BxT, depth)
  chains_BxT = metrics.teacher_forced_accept_lengths(np.argmax(logits_BxTxV, -1), np.argmax(draft_logits_JxBxTxV, -1),
                                                     valid_BxT)
  wants, from_context = [], 0
  for b, (prompt, seq) in enumerate(zip(prompts, seqs)):
    pending, want = len(prompt), []
    while pending - len(prompt) + 1 < MAX_NEW:
      drafts = _lookup(seq[:pending + 1], depth, ngram)
      a = int(np.sum(np.cumprod(np.equal(drafts, seq[pending + 1:pending + 1 + len(drafts)]))))
      if source == 'both':
        from_context += a > chains_BxT[b, pending - 1]
        a = max(a, int(chains_BxT[b, pending - 1]))
      want.append(a)
      pending += a + 1
    wants.append(want)
  return [s[len(p):len(p) + MAX_NEW] for p, s in zip(prompts, seqs)], wants, from_context


@pytest.mark.parametrize('source,depth', [('context', 1), ('context', 3), ('both', 2), ('both', 3)])
def test_online_acceptance_equals_a_replay_of_plain_greedy(models, source, depth):
  """Each step accepts what the reference lookup's drafts (and, for 'both', the heads' teacher-forced
  chain) match of plain greedy's continuation: 'both' takes the longer of its two paths."""
  prompts, ngram, won = _prompts(), 3, 0
  for name, model in models.items():
    spec = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=depth, draft_source=source,
                           ngram=ngram)
    tokens, wants, from_context = _replay(model, prompts, source, depth, ngram)
    for b in range(len(prompts)):
      np.testing.assert_array_equal(spec.tokens[b], tokens[b], err_msg=f'{name} model, prompt {b}')
      np.testing.assert_array_equal(spec.accept_lengths[b], wants[b], err_msg=f'{name} model, prompt {b}')
    won += from_context
    if name == 'looping':  # the copies pay where the output loops
      assert np.mean(np.concatenate(spec.accept_lengths)) > 0.4
  if source == 'both':
    assert won >= 3  # path 1 wins some steps, so keep_path's copy is exercised


def test_a_model_without_heads_decodes_from_the_context_alone():
  model = MTPTransformer(dataclasses.replace(CFG, num_mtp_heads=0), rngs=nnx.Rngs(2))
  prompts = _prompts()
  plain = decode.generate(model, prompts, max_new_tokens=MAX_NEW)
  spec = decode.generate(model, prompts, max_new_tokens=MAX_NEW, draft_depth=3, draft_source='context')
  for want, got in zip(plain.tokens, spec.tokens):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="or draft_source='context'"):
    decode.generate(model, prompts, max_new_tokens=4, draft_depth=2)


@pytest.mark.parametrize('source,out_major', [('context', True), ('both', True), ('both', False)])
def test_context_drafts_keep_greedy_output_with_a_draft_vocabulary_in_both_layouts(trained, source, out_major):
  """The draft vocabulary restricts the heads' path only; the context path copies any id."""
  prompts = _prompts()
  plain = decode.generate(trained, prompts, max_new_tokens=MAX_NEW)
  opts = decode.options(MAX_NEW, draft_depth=2, draft_source=source, draft_vocab=np.arange(8, 30))
  spec = decode.generate_split(*decode.split(trained, out_major=out_major), prompts, opts)
  for want, got in zip(plain.tokens, spec.tokens):
    np.testing.assert_array_equal(got, want)


def _uniform_laws(nodes_BxNodes, vocab_size):
  return jax.numpy.zeros(nodes_BxNodes.shape + (vocab_size,))


@pytest.mark.parametrize('source,broken', [('context', False), ('both', False), ('context', True)])
def test_sampling_with_context_drafts_is_lossless_and_needs_their_one_hot_q(sampling_setup, source, broken, monkeypatch):
  """A context draft is a fixed token (q one-hot): accepted with probability p(x), else the residual.
  Reading it as a draw from a uniform q biases the output, and the test sees it."""
  model, prompt, law = sampling_setup
  patch = (drafting, '_one_hot_laws', _uniform_laws) if broken else None
  pvalue, impossible = _chi_square_with(monkeypatch, patch, model, prompt, law, draft_depth=2, seed=6,
                                        draft_source=source, ngram=2)
  if broken:
    assert pvalue < 1e-6, 'the chi-square test misses context drafts read as uniform draws'
  else:
    assert pvalue > 1e-3 and impossible == 0


def test_bad_context_settings_are_refused_in_one_line():
  for kwargs, message in ((dict(source='lookup'), "must be one of"), (dict(source='both', tree=(2, 1)), 'drafts chains'),
                          (dict(source='context', min_prob=0.5), 'no head probabilities'),
                          (dict(source='context', ngram=0), 'ngram=0')):
    with pytest.raises(ValueError, match=message):
      drafting.DraftPlan(2, **kwargs)
  assert drafting.DraftPlan(0, source='context') == drafting.DraftPlan()  # depth 0 is plain decoding
  assert drafting.DraftPlan(3, source='both').verified == 7 and drafting.DraftPlan(3, source='both').paths == 2
