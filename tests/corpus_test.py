"""Tests of the embedded corpus and its tokenizer: round trips, caching, token file, held-out split."""

import json
import os

import numpy as np
import pytest

from mtpd_jax.harness import corpus, packages
from mtpd_jax.harness import tokenizer as tokenizer_lib

SMALL = dict(vocab_size=512, max_chars=300_000)

ROUND_TRIP_TEXTS = [
    '',
    'Hello, world!',
    'Prices rose 12.5% to $1,234,567.89 in 2024-03-01.',
    'ünïcödé, 中文, 日本語, emoji 😀🚀, combining é, RTL עברית',
    'def f(x):\n    if x:\n\t\treturn x ** 2  # tab and spaces\n\n\n    return None\r\n',
    '  leading and trailing spaces  \n\n',
    'literal special strings: <|endoftext|> <|im_start|>user\n<|im_end|>',
]


@pytest.fixture(scope='module')
def small(tmp_path_factory):
  return corpus.prepare_embedded(str(tmp_path_factory.mktemp('cache')), **SMALL)


@pytest.fixture(scope='module')
def tok(small):
  return small.tokenizer()


@pytest.mark.parametrize('text', ROUND_TRIP_TEXTS)
def test_round_trip_is_exact(tok, text):
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.eos_id not in ids and tok.im_start_id not in ids  # special strings stay text


def test_digits_are_single_tokens(tok):
  ids = tok.encode('9876543210')
  assert [tok.decode([i]) for i in ids] == list('9876543210')


def test_special_ids_and_chat_prompt(tok):
  assert (tok.eos_id, tok.im_start_id, tok.im_end_id) == (0, 1, 2)
  ids = tok.chat_prompt(tok.encode('Hi there'))
  assert tok.decode(ids) == '<|im_start|>user\nHi there<|im_end|><|im_start|>assistant\n'
  assert tok.chat_overhead == len(ids) - len(tok.encode('Hi there'))


def test_train_bpe_is_cached_by_its_inputs(tmp_path, monkeypatch):
  texts = ['the quick brown fox 123', 'jumps over the lazy dog'] * 20
  calls = []
  real_train = tokenizer_lib._train
  monkeypatch.setattr(tokenizer_lib, '_train', lambda *a: calls.append(a) or real_train(*a))
  first = tokenizer_lib.train_bpe(texts, vocab_size=300, cache_dir=str(tmp_path))
  second = tokenizer_lib.train_bpe(texts, vocab_size=300, cache_dir=str(tmp_path))
  assert len(calls) == 1
  assert first.encode('the lazy fox') == second.encode('the lazy fox')
  tokenizer_lib.train_bpe(texts, vocab_size=301, cache_dir=str(tmp_path))
  tokenizer_lib.train_bpe(texts + ['x'], vocab_size=300, cache_dir=str(tmp_path))
  assert len(calls) == 3
  assert len(os.listdir(tmp_path)) == 3


def test_train_bpe_rejects_too_small_vocab():
  with pytest.raises(ValueError, match='256 bytes'):
    tokenizer_lib.train_bpe(['abc'], vocab_size=200)


def test_prepare_reuses_the_cache(small, monkeypatch):
  mtime = os.path.getmtime(small.train_tokens_path)
  def fail(*a, **k):
    raise AssertionError('retrained although the cache entry exists')
  monkeypatch.setattr(tokenizer_lib, 'train_bpe', fail)
  again = corpus.prepare_embedded(os.path.dirname(os.path.dirname(small.train_tokens_path)), **SMALL)
  assert again == small
  assert os.path.getmtime(small.train_tokens_path) == mtime


def test_key_changes_with_every_input(monkeypatch):
  base = dict(vocab_size=512, max_chars=300_000, code_fraction=0.25, seed=0)
  keys = {corpus.embedded_key(**base)}
  for name, value in [('vocab_size', 520), ('max_chars', 300_001), ('code_fraction', 0.5), ('seed', 1)]:
    keys.add(corpus.embedded_key(**{**base, name: value}))
  monkeypatch.setattr(corpus, '_version', lambda dist: 'other')
  keys.add(corpus.embedded_key(**base))
  assert len(keys) == 6


def test_token_file_layout(small):
  tokens = np.load(small.train_tokens_path)
  with open(os.path.join(os.path.dirname(small.train_tokens_path), 'meta.json')) as f:
    meta = json.load(f)
  assert tokens.dtype == np.uint16 and tokens.ndim == 1 and tokens.size == small.num_tokens
  assert small.eos_id == 0 and small.vocab_size == 512
  assert int(tokens.max()) < small.vocab_size
  assert tokens[-1] == small.eos_id
  # One EOS per document and none inside one (text never encodes to a special id).
  assert int((tokens == small.eos_id).sum()) == meta['num_chat_docs'] + meta['num_code_docs']
  assert meta['num_chat_docs'] > 0 and meta['num_code_docs'] > 0
  assert 200_000 <= meta['num_chars'] <= 500_000  # the budget, overshot by at most the last documents


def test_held_out_prompts_do_not_occur_in_training_text(small, tok):
  text = tok.decode(np.load(small.train_tokens_path))
  assert 'def ' in text and '<|im_start|>assistant\n' in text  # both kinds of document
  for name in corpus.PROMPT_SETS:
    leaked = [p for p in corpus.prompt_texts(name) if p in text]
    assert not leaked, f'{name} prompts found in training text: {leaked[:3]}'


def test_contaminated_documents_are_dropped():
  chat_prompt, code_prompt = corpus.prompt_texts('chat')[0], corpus.prompt_texts('code')[3]
  docs = [[('user', 'clean question'), ('assistant', 'clean answer')],
          [('user', 'please: ' + chat_prompt + ' thanks'), ('assistant', 'ok')],
          [(None, '# a file\n' + code_prompt + '    pass\n')],
          [(None, 'x = 1\n')]]
  kept, dropped = corpus._drop_contaminated(docs)
  assert kept == [docs[0], docs[3]] and dropped == 2


def test_held_out_split_groups_conversation_parts():
  ids = [f'conv{i}' for i in range(20_000)]
  held = [corpus.is_held_out(i) for i in ids]
  assert 0.025 < np.mean(held) < 0.04  # 1 in HELD_OUT_BUCKETS
  assert all(corpus.is_held_out(f'{i}_{k}') == h for i, h in zip(ids[:500], held) for k in (0, 3, 11))


@pytest.mark.parametrize('chunk_chars', [7, 1 << 20])
def test_iter_json_array_stops_at_a_cut_off_record(tmp_path, chunk_chars):
  records = [{'id': f'r{i}', 'conversations': [{'from': 'human', 'value': 'x,]}' * i}]} for i in range(5)]
  text = json.dumps(records, indent=2)
  path = tmp_path / 'cut.json'
  path.write_text(text[:text.index('"r4"') + 20])  # cut inside the last record, as in ShareGPT
  got = list(corpus.iter_json_array(str(path), chunk_chars=chunk_chars))
  assert got == records[:4]


def test_iter_json_array_reads_a_complete_array(tmp_path):
  path = tmp_path / 'full.json'
  path.write_text(json.dumps([{'a': 1}, {'b': [2, 3]}]))
  assert list(corpus.iter_json_array(str(path), chunk_chars=3)) == [{'a': 1}, {'b': [2, 3]}]


def test_stdlib_files_skip_tests_and_site_packages():
  files = corpus.stdlib_files()
  assert 'os.py' in files and os.path.join('json', 'decoder.py') in files
  parts = {p for f in files for p in f.split(os.sep)[:-1]}
  assert not parts & {'test', 'tests', 'site-packages', 'idle_test', 'encodings'}


def test_missing_package_names_the_pip_command():
  with pytest.raises(FileNotFoundError, match='pip install --no-deps no-such-pkg==1'):
    packages.package_file(('no_such_pkg_mtpd', 'data/x.json', 'no-such-pkg==1'))
