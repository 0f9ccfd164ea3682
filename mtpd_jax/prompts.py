"""Evaluation prompts as token ids: the built-in chat / code / math sets and user JSONL files.

Built-in sets mirror the paper's benchmark groups with data shipped in registry packages:
`chat` (first user turns of held-out ShareGPT conversations), `code` (HumanEval prompts) and
`math` (CHAMP competition problems). Long prompts keep their end: decoding continues from it.
"""

import gzip
import json
import os
from collections.abc import Sequence

import numpy as np

from mtpd_jax import corpus

PROMPT_SETS = corpus.PROMPT_SETS


def encode_prompts(texts: Sequence[str], *, tokenizer, max_prompt_tokens: int,
                   chat_template: bool = False) -> list[np.ndarray]:
  """Token ids (1-D int32) of each text, cut from the left to `max_prompt_tokens` in all.

  With `chat_template` the text becomes a user turn followed by the assistant header; the cut
  falls inside the user text, so the template tokens always survive.
  """
  overhead = tokenizer.chat_overhead if chat_template else 0
  budget = max_prompt_tokens - overhead
  if budget < 1:
    raise ValueError(f'max_prompt_tokens {max_prompt_tokens} leaves no room for text '
                     f'(the chat template takes {overhead})')
  out = []
  for ids in tokenizer.encode_batch(list(texts)):
    ids = ids[-budget:]
    out.append(np.asarray(tokenizer.chat_prompt(ids) if chat_template else ids, np.int32))
  return out


def load_prompt_set(name: str, *, tokenizer, max_prompts: int | None = 64,
                    max_prompt_tokens: int = 512, chat_template: bool = False) -> list[np.ndarray]:
  """The first `max_prompts` prompts of a built-in set ('chat', 'code', 'math'), in a fixed order."""
  texts = corpus.prompt_texts(name)[:max_prompts]
  return encode_prompts(texts, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens,
                        chat_template=chat_template)


def read_jsonl_texts(path: str, *, field: str = 'prompt') -> list[str]:
  """The string `field` of every record of a JSONL file (`.jsonl` or `.jsonl.gz`), in file order."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'prompt file {path} does not exist')
  opener = gzip.open if path.endswith('.gz') else open
  texts = []
  with opener(path, 'rt', encoding='utf-8') as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{line_no}: not valid JSON ({e.msg})') from e
      if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise KeyError(f'{path}:{line_no}: no field {field!r} (record has {keys})')
      if not isinstance(record[field], str) or not record[field]:
        raise ValueError(f'{path}:{line_no}: field {field!r} is not a non-empty string')
      texts.append(record[field])
  if not texts:
    raise ValueError(f'prompt file {path} holds no records')
  return texts


def load_jsonl_prompts(path: str, *, tokenizer, field: str = 'prompt', max_prompts: int | None = None,
                       max_prompt_tokens: int = 512, chat_template: bool = False) -> list[np.ndarray]:
  """Prompts from a user JSONL file (e.g. GSM8K or MATH exported locally), in file order."""
  texts = read_jsonl_texts(path, field=field)[:max_prompts]
  return encode_prompts(texts, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens,
                        chat_template=chat_template)


def check_jsonl_prompts(path: str, *, field: str = 'prompt', vocab_size: int, text_ok: bool,
                        max_ids: int | None = None) -> int:
  """Read a prompt file through once before any work and raise naming `path:line` at the first bad record.

  Each record is a JSON object whose `field` holds non-empty text (only when `text_ok`: the run has a
  tokenizer) or a non-empty list of token ids in [0, vocab_size), at most `max_ids` (model.max_seq_len) of them.
  Returns the number of records.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f'prompt file {path} does not exist')
  count = 0
  with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
    for line_no, raw in enumerate(f, 1):
      where = f'prompt file {path}:{line_no}'
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise ValueError(f'{where}: not UTF-8 text ({e.reason} at byte {e.start})') from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{where}: not valid JSON ({e.msg}, column {e.colno})') from None
      if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else f'a JSON {type(record).__name__}, not an object'
        raise ValueError(f'{where}: no field {field!r} (record has {keys})')
      value = record[field]
      if isinstance(value, str):
        if not value:
          raise ValueError(f'{where}: field {field!r} is empty')
        if not text_ok:
          raise ValueError(f'{where}: field {field!r} holds text, but only the embedded data source has a '
                           'tokenizer; give token ids (a list of ints) instead')
      elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
          raise ValueError(f'{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})')
        if max_ids is not None and len(value) > max_ids:
          raise ValueError(f'{where}: {len(value)} prompt ids exceed model.max_seq_len={max_ids}')
      else:
        raise ValueError(f'{where}: field {field!r} must be text or a non-empty list of token ids, '
                         f'not {json.dumps(value)[:40]}')
      count += 1
  if not count:
    raise ValueError(f'prompt file {path} holds no records')
  return count
