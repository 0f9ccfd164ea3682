"""Tests of the evaluation prompt sets and the user JSONL loader."""

import gzip
import json
import types

import numpy as np
import pytest

from conftest import small_config
from mtpd_jax.harness import corpus
from mtpd_jax.harness import prompts, recipe
from mtpd_jax.harness import tokenizer as tokenizer_lib


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  texts = list(corpus.prompt_texts('code')) + list(corpus.prompt_texts('math')[:50])
  return tokenizer_lib.train_bpe(texts, vocab_size=400, cache_dir=str(tmp_path_factory.mktemp('tok')))


@pytest.mark.parametrize('name, count', [('chat', 200), ('code', 164), ('math', 270)])
def test_prompt_sets_are_non_empty_and_deterministic(tok, name, count):
  texts = corpus.prompt_texts(name)
  assert len(texts) >= count and len(set(texts)) == len(texts)
  first = prompts.load_prompt_set(name, tokenizer=tok, max_prompts=8, max_prompt_tokens=4096)
  corpus.prompt_texts.cache_clear()  # the second load reads the package files again
  second = prompts.load_prompt_set(name, tokenizer=tok, max_prompts=8, max_prompt_tokens=4096)
  assert len(first) == 8
  for a, b, text in zip(first, second, texts):
    assert a.dtype == np.int32 and a.ndim == 1 and a.size > 0
    np.testing.assert_array_equal(a, b)
    assert tok.decode(a) == text  # 4096 tokens: nothing cut


def test_known_first_prompts():
  assert corpus.prompt_texts('code')[0].startswith('from typing import List\n\n\ndef has_close_elements(')
  assert corpus.prompt_texts('math')[0].startswith('Let a string consist of digit 1, 2, 3.')
  chat = corpus.prompt_texts('chat')
  assert min(len(t) for t in chat) >= corpus.MIN_CHAT_PROMPT_CHARS
  assert all(t == t.strip() for t in chat)


def test_long_prompts_keep_their_end(tok):
  full = prompts.load_prompt_set('code', tokenizer=tok, max_prompts=5, max_prompt_tokens=100_000)
  cut = prompts.load_prompt_set('code', tokenizer=tok, max_prompts=5, max_prompt_tokens=16)
  for f, c in zip(full, cut):
    assert f.size > 16
    np.testing.assert_array_equal(c, f[-16:])


def test_chat_template_wraps_the_cut_text(tok):
  [ids] = prompts.encode_prompts(['a' * 50 + ' the end'], tokenizer=tok, max_prompt_tokens=20,
                                 chat_template=True)
  text = tok.decode(ids)
  assert ids.size == 20 and ids[0] == tok.im_start_id
  assert text.startswith('<|im_start|>user\n') and text.endswith('the end<|im_end|><|im_start|>assistant\n')
  with pytest.raises(ValueError, match='no room'):
    prompts.encode_prompts(['x'], tokenizer=tok, max_prompt_tokens=tok.chat_overhead, chat_template=True)


def test_unknown_prompt_set(tok):
  with pytest.raises(ValueError, match="expected one of \\('chat', 'code', 'math'\\)"):
    prompts.load_prompt_set('gsm8k', tokenizer=tok)


def _write(path, lines):
  path.write_text(''.join(line + '\n' for line in lines))
  return str(path)


def test_jsonl_prompts(tok, tmp_path):
  path = _write(tmp_path / 'p.jsonl', [json.dumps({'question': 'What is 2+2?', 'answer': '4'}), '',
                                       json.dumps({'question': 'Name a prime.'})])
  got = prompts.load_jsonl_prompts(path, tokenizer=tok, field='question')
  assert [tok.decode(g) for g in got] == ['What is 2+2?', 'Name a prime.']
  assert len(prompts.load_jsonl_prompts(path, tokenizer=tok, field='question', max_prompts=1)) == 1
  gz = tmp_path / 'p.jsonl.gz'
  with gzip.open(gz, 'wt') as f:
    f.write(json.dumps({'prompt': 'zipped'}) + '\n')
  assert [tok.decode(g) for g in prompts.load_jsonl_prompts(str(gz), tokenizer=tok)] == ['zipped']


def test_jsonl_token_ids_are_cut_from_the_left_and_text_may_become_a_chat_turn(tok, tmp_path):
  path = _write(tmp_path / 'p.jsonl', [json.dumps({'prompt': [3, 1, 4, 1, 5]}), json.dumps({'prompt': 'hi there'})])
  ids, text = prompts.load_jsonl_prompts(path, tokenizer=tok, max_prompt_tokens=3)
  assert ids.tolist() == [4, 1, 5] and ids.dtype == np.int32
  assert tok.decode(text) == ' there'  # text is cut from the left as well
  _, chat = prompts.load_jsonl_prompts(path, tokenizer=tok, chat_template=True)
  assert chat.tolist() == tok.chat_prompt(tok.encode('hi there'))
  only_ids = _write(tmp_path / 'ids.jsonl', [json.dumps({'prompt': [2, 7]})])
  assert prompts.load_jsonl_prompts(only_ids)[0].tolist() == [2, 7]  # ids need no tokenizer
  with pytest.raises(ValueError, match="p.jsonl:2: field 'prompt' holds text, but only the embedded"):
    prompts.load_jsonl_prompts(path)


@pytest.mark.parametrize('lines, match', [
    ([json.dumps({'prompt': 'ok'}), json.dumps({'text': 'no prompt'})], r"p.jsonl:2: no field 'prompt'.*\['text'\]"),
    ([json.dumps({'prompt': 'ok'}), '{not json'], 'p.jsonl:2: not valid JSON'),
    ([json.dumps({'prompt': 3})], "p.jsonl:1: field 'prompt' must be text or a non-empty list of token ids"),
    ([json.dumps(['prompt'])], "p.jsonl:1: no field 'prompt'"),
    (['', '  '], 'holds no records'),
])
def test_jsonl_errors(tok, tmp_path, lines, match):
  path = _write(tmp_path / 'p.jsonl', lines)
  with pytest.raises(ValueError, match=match):
    prompts.load_jsonl_prompts(path, tokenizer=tok)


def test_jsonl_missing_file(tok, tmp_path):
  with pytest.raises(FileNotFoundError, match='does not exist'):
    prompts.load_jsonl_prompts(str(tmp_path / 'nope.jsonl'), tokenizer=tok)


@pytest.mark.parametrize('mode, template, want', [
    ('auto', '{% for m in messages %}...{% endfor %}', True), ('auto', None, False),
    ('on', None, True), ('off', '{% for m in messages %}...{% endfor %}', False)])
def test_jsonl_text_gets_the_chat_template_of_an_instruct_tokenizer(mode, template, want):
  config = small_config()
  config.eval.chat_template = mode
  assert recipe.use_chat_template(config, types.SimpleNamespace(chat_template=template)) is want
  assert recipe.use_chat_template(config, None) is (mode == 'on')
