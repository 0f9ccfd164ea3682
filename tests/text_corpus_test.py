"""data.source='text': a user's .jsonl or .txt, tokenized once into the token file the other sources
use; the cache is reused until the file changes; each bad file is one line naming file and line."""

import json
import os

import numpy as np
import pytest

from conftest import small_config
from mtpd_jax.harness import pretrained, recipe, text_corpus, training

pytestmark = pytest.mark.reliability

DOCS = ['The first document: plain prose, with digits 1234.', 'def second(x):\n    return x * 2\n']
CHAT = [{'role': 'user', 'content': 'What is 2 + 2?'}, {'role': 'assistant', 'content': 'It is 4.'}]


def _jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  return str(path)


def test_jsonl_txt_and_chats_tokenize_to_the_documents_ids_each_followed_by_eos(tmp_path):
  tok = pretrained.load_tokenizer('smollm2')
  cache = str(tmp_path / 'cache')
  plain = text_corpus.prepare_text(_jsonl(tmp_path / 'a.jsonl', [{'text': d, 'id': i} for i, d in enumerate(DOCS)]),
                                   tokenizer='smollm2', cache_dir=cache, progress=False)
  want = [i for d in DOCS for i in tok.encode(d) + [tok.eos_id]]
  np.testing.assert_array_equal(np.load(plain.train_tokens_path), want)
  txt = tmp_path / 'b.txt'
  txt.write_text(DOCS[0])
  np.testing.assert_array_equal(np.load(text_corpus.prepare_text(str(txt), tokenizer='smollm2', cache_dir=cache,
                                                                 progress=False).train_tokens_path),
                                tok.encode(DOCS[0]) + [tok.eos_id])
  chats = text_corpus.prepare_text(_jsonl(tmp_path / 'c.jsonl', [{'messages': CHAT}]), field='messages',
                                   tokenizer='smollm2', cache_dir=cache, progress=False)
  want = tok.chat([(m['role'], tok.encode(m['content'])) for m in CHAT]) + [tok.eos_id]
  np.testing.assert_array_equal(np.load(chats.train_tokens_path), want)
  assert plain.eos_id == tok.eos_id and plain.tokenizer().eos_id == tok.eos_id


def test_the_cache_is_reused_until_the_file_changes(tmp_path):
  cache, path = str(tmp_path / 'cache'), _jsonl(tmp_path / 'a.jsonl', [{'text': d} for d in DOCS])
  first = text_corpus.prepare_text(path, tokenizer='smollm2', cache_dir=cache, progress=False)
  stamp = os.stat(first.train_tokens_path).st_mtime_ns
  again = text_corpus.prepare_text(path, tokenizer='smollm2', cache_dir=cache, progress=False)
  assert again.train_tokens_path == first.train_tokens_path
  assert os.stat(again.train_tokens_path).st_mtime_ns == stamp
  _jsonl(tmp_path / 'a.jsonl', [{'text': d} for d in DOCS[::-1]])  # same name, other contents
  changed = text_corpus.prepare_text(path, tokenizer='smollm2', cache_dir=cache, progress=False)
  assert changed.train_tokens_path != first.train_tokens_path
  assert len([n for n in os.listdir(cache) if n.startswith('text-')]) == 2


@pytest.mark.parametrize('name, content, message', [
    ('empty.jsonl', b'\n\n', 'empty.jsonl is empty'),
    ('latin1.jsonl', b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r'latin1.jsonl, line 2: not UTF-8 text'),
    ('field.jsonl', b'{"text": "ok"}\n{"body": "no text field"}\n', r"field.jsonl, line 2: no field 'text'"),
    ('broken.jsonl', b'{"text": "ok"}\n{"text": \n', r'broken.jsonl, line 2: not valid JSON'),
    ('number.jsonl', b'{"text": 7}\n', r"number.jsonl, line 1: field 'text' holds int, not text"),
    ('table.parquet', b'PAR1', 'parquet needs pyarrow'),
    ('notes.md', b'# notes', r'reads .jsonl or .txt files'),
])
def test_each_bad_file_is_named_in_one_line(tmp_path, name, content, message):
  (tmp_path / name).write_bytes(content)
  with pytest.raises(ValueError, match=message):
    text_corpus.prepare_text(str(tmp_path / name), tokenizer='smollm2', cache_dir=str(tmp_path / 'cache'),
                             progress=False)
  assert not (tmp_path / 'cache').exists() or not os.listdir(tmp_path / 'cache')
  with pytest.raises(IsADirectoryError, match='is a directory'):
    text_corpus.check_file(str(tmp_path))


@pytest.mark.slow
def test_a_run_trains_and_evaluates_on_a_text_file_with_its_own_bpe(tmp_path):
  path = _jsonl(tmp_path / 'corpus.jsonl', [{'text': f'{d} Line {i}. ' * 20} for i, d in enumerate(DOCS * 40)])
  config = small_config(num_mtp_heads=1, steps=4)
  config.model.vocab_size = 512
  config.data.update(source='text', train_path=path, tokenizer='bpe', cache_dir=str(tmp_path / 'cache'))
  config.eval.update(max_prompts=2, max_new_tokens=4, repeats=1, timing_steps=2, timing_repeats=1)
  from mtpd_jax.harness import experiment  # pylint: disable=import-outside-toplevel
  training.train_and_evaluate(config, str(tmp_path / 'run'), progress=False)
  result = experiment.evaluate_workdir(str(tmp_path / 'run'), write=False)
  assert set(result['prompt_sets']) == {'chat', 'code', 'math'}
  assert all(r['lossless'] for r in result['prompt_sets'].values())
  assert len(recipe.make_source(config, 'train')) > 0 and len(recipe.make_source(config, 'eval')) > 0
