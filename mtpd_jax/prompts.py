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
