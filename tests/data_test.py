"""Data: packing with document ids, token files, the synthetic source, process slicing, resume."""

import numpy as np
import pytest

from mtpd_jax import data


def test_pack_window_gives_document_ids_with_eos_ending_its_document():
  rec = data.pack_window(np.array([5, 6, 0, 7, 8, 0, 9]), eos_id=0)
  np.testing.assert_array_equal(rec['inputs'], [5, 6, 0, 7, 8, 0])
  np.testing.assert_array_equal(rec['targets'], [6, 0, 7, 8, 0, 9])
  np.testing.assert_array_equal(rec['segment_ids'], [1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(rec['target_segment_ids'], [1, 1, 2, 2, 2, 3])


def test_packed_tokens_windows_splits_and_validation(tmp_path):
  path = str(tmp_path / 'tokens.npy')
  np.save(path, np.arange(101, dtype=np.uint16) % 50)
  src = data.PackedTokens(path, seq_len=10, eos_id=0, vocab_size=50)
  assert len(src) == 10
  np.testing.assert_array_equal(src[3]['inputs'], np.arange(30, 40) % 50)
  np.testing.assert_array_equal(src[3]['targets'], np.arange(31, 41) % 50)
  train, held = (data.PackedTokens(path, 10, 0, split=s) for s in ((0.0, 0.8), (0.8, 1.0)))
  assert len(train) == 8 and len(held) == 2
  np.testing.assert_array_equal(held[0]['inputs'], src[8]['inputs'])
  with pytest.raises(ValueError, match='>= vocab_size 40'):
    data.PackedTokens(path, 10, 0, vocab_size=40)
  with pytest.raises(FileNotFoundError):
    data.PackedTokens(str(tmp_path / 'missing.npy'), 10, 0)


def test_synthetic_source_is_deterministic_and_predictable():
  src = data.SyntheticSource(vocab_size=64, seq_len=32, num_records=10, seed=3)
  a, b = src[4], src[4]
  np.testing.assert_array_equal(a['inputs'], b['inputs'])
  assert not np.array_equal(src[4]['inputs'], src[5]['inputs'])
  assert a['inputs'].max() < 64 and a['inputs'].min() >= 0
  # Inside a document the stride is constant: the third token on is predictable.
  toks, seg = a['inputs'], a['segment_ids']
  for i in range(2, 31):
    if seg[i - 2] == seg[i] and toks[i] != 0 and toks[i - 1] != 0 and toks[i - 2] != 0:
      assert (toks[i] - toks[i - 1]) % 63 == (toks[i - 1] - toks[i - 2]) % 63


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_process_slices_compose_the_single_process_batches():
  src = data.SyntheticSource(vocab_size=64, seq_len=8, num_records=40, seed=0)
  whole = _take(data.make_iterator(src, global_batch=8, seed=1), 7)   # crosses an epoch boundary
  parts = [_take(data.make_iterator(src, global_batch=8, seed=1, process_index=p, process_count=2), 7)
           for p in range(2)]
  for step in range(7):
    joined = np.concatenate([parts[0][step]['inputs'], parts[1][step]['inputs']])
    np.testing.assert_array_equal(joined, whole[step]['inputs'])
  with pytest.raises(ValueError, match='not divisible by 3 processes'):
    data.make_iterator(src, global_batch=8, seed=1, process_count=3)


def test_iterator_state_resumes_the_identical_next_batch():
  src = data.SyntheticSource(vocab_size=64, seq_len=8, num_records=40, seed=0)
  it = data.make_iterator(src, global_batch=4, seed=2)
  _take(it, 3)
  state = it.get_state()
  expected = _take(it, 2)
  fresh = data.make_iterator(src, global_batch=4, seed=2)
  fresh.set_state(state)
  for want, got in zip(expected, _take(fresh, 2)):
    np.testing.assert_array_equal(want['inputs'], got['inputs'])
