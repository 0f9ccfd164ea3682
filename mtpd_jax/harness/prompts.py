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

from mtpd_jax.harness import corpus

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


def _jsonl_records(path: str, field: str):
  """(where, value of `field`) for each non-blank line of a JSONL file (.gz ok); errors name path:line."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'prompt file {path} does not exist')
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
      yield where, record[field]


def read_jsonl_prompts(path: str, *, field: str = 'prompt', text_ok: bool = True, vocab_size: int | None = None,
                       max_ids: int | None = None) -> list[str | list[int]]:
  """The `field` of every record, in file order: non-empty text, or a non-empty list of token ids.

  Text only when `text_ok` (the run has a tokenizer); ids must lie in [0, vocab_size) and number at
  most `max_ids` (model.max_seq_len). The first bad record raises ValueError naming `path:line`.
  """
  values = []
  for where, value in _jsonl_records(path, field):
    if isinstance(value, str):
      if not value:
        raise ValueError(f'{where}: field {field!r} is empty')
      if not text_ok:
        raise ValueError(f'{where}: field {field!r} holds text, but only the embedded data source has a '
                         'tokenizer; give token ids (a list of ints) instead')
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
      bad = [t for t in value if not 0 <= t < (vocab_size or np.iinfo(np.int32).max)]
      if bad:
        raise ValueError(f'{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})')
      if max_ids is not None and len(value) > max_ids:
        raise ValueError(f'{where}: {len(value)} prompt ids exceed model.max_seq_len={max_ids}')
    else:
      raise ValueError(f'{where}: field {field!r} must be text or a non-empty list of token ids, '
                       f'not {json.dumps(value)[:40]}')
    values.append(value)
  if not values:
    raise ValueError(f'prompt file {path} holds no records')
  return values


def check_jsonl_prompts(path: str, *, field: str = 'prompt', vocab_size: int, text_ok: bool,
                        max_ids: int | None = None) -> int:
  """Read a prompt file through once before any work (`read_jsonl_prompts`'s checks); the record count."""
  return len(read_jsonl_prompts(path, field=field, text_ok=text_ok, vocab_size=vocab_size, max_ids=max_ids))


def load_jsonl_prompts(path: str, *, tokenizer=None, field: str = 'prompt', max_prompts: int | None = None,
                       max_prompt_tokens: int = 512, chat_template: bool = False) -> list[np.ndarray]:
  """Prompts from a user JSONL file (e.g. GSM8K or MATH exported locally), in file order.

  Text is encoded (as a chat user turn with `chat_template`) and cut like the built-in sets; token
  ids are taken as they are, cut from the left to `max_prompt_tokens`.
  """
  values = read_jsonl_prompts(path, field=field, text_ok=tokenizer is not None)[:max_prompts]
  texts = [v for v in values if isinstance(v, str)]
  encoded = iter(encode_prompts(texts, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens,
                                chat_template=chat_template) if texts else [])
  return [next(encoded) if isinstance(v, str) else np.asarray(v[-max_prompt_tokens:], np.int32) for v in values]
