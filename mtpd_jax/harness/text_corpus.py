"""`data.source='text'`: the user's own corpus, tokenized once into the token file the embedded
source uses too (a 1-D .npy, documents each followed by EOS), then windows like any token file.

`data.train_path` names a `.jsonl` file (each line a JSON object: its `data.text_field` string is
one document, or, when that field is `messages`, a chat rendered with the tokenizer's template:
a list of {'role', 'content'}) or a `.txt` file (one document: the whole file). Parquet is not
read: pyarrow is not among this project's pinned packages; convert such a file to JSONL. The
tokenizer is `data.tokenizer`: a pretrained checkpoint's own (pretrained.py), or 'bpe', a
byte-level BPE of `model.vocab_size` tokens trained on the text (cached by its inputs).

The result lives in `<cache dir>/text-<key>/`, keyed by the file's sha256, the field and the
tokenizer (its fingerprint, or the BPE's settings), and is renamed into place only when whole, so a
second run reuses it and a changed file builds another. An empty file, one that is not UTF-8, a
line that is not a JSON object or lacks the field, is refused in one line naming file and line.
"""

import dataclasses
import hashlib
import json
import os
import shutil

import numpy as np

from mtpd_jax import runtime
from mtpd_jax.harness import pretrained, tokenizer as tokenizer_lib

FORMAT = 'text/v1'
SUFFIXES = ('.jsonl', '.txt')


@dataclasses.dataclass(frozen=True)
class TextData:
  """A tokenized text corpus: its token file, EOS id and tokenizer."""
  train_tokens_path: str
  eos_id: int
  tokenizer_ref: str
  tokenizer_path: str

  def tokenizer(self) -> tokenizer_lib.Tokenizer:
    if self.tokenizer_ref != 'bpe':
      return pretrained.load_tokenizer(self.tokenizer_ref)
    return tokenizer_lib.Tokenizer.load(self.tokenizer_path)


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      h.update(chunk)
  return h.hexdigest()


def check_file(path: str) -> None:
  """Refuse a path that cannot be a text corpus, before any work, in one line."""
  if os.path.isdir(path):
    raise IsADirectoryError(f'data.train_path={path} is a directory; name a .jsonl or .txt file')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'text file {path} does not exist')
  if path.endswith('.parquet'):
    raise ValueError(f'{path}: parquet needs pyarrow, which is not among the pinned packages; '
                     'convert it to JSONL (one {"text": ...} object per line)')
  if not path.endswith(SUFFIXES):
    raise ValueError(f'{path}: data.source=text reads {" or ".join(SUFFIXES)} files')


def read_documents(path: str, field: str) -> list:
  """The documents of a .jsonl or .txt file: strings, or chats (lists of (role, text)) when `field`
  is 'messages'; every problem is one ValueError naming the file and line."""
  check_file(path)
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except UnicodeDecodeError as e:
    line = 1 + open(path, 'rb').read()[:e.start].count(b'\n')
    raise ValueError(f'{path}, line {line}: not UTF-8 text ({e.reason} at byte {e.start})') from None
  if not text.strip():
    raise ValueError(f'{path} is empty')
  if path.endswith('.txt'):
    return [text]
  docs = []
  for i, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}, line {i}: not valid JSON ({e.msg})') from None
    if not isinstance(record, dict) or field not in record:
      raise ValueError(f'{path}, line {i}: no field {field!r} (set data.text_field to the field that holds the text)')
    value = record[field]
    if field == 'messages':
      if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get('content'), str)
                                                and isinstance(m.get('role'), str) for m in value):
        raise ValueError(f"{path}, line {i}: 'messages' must be a list of {{'role', 'content'}} strings")
      docs.append([(m['role'], m['content']) for m in value])
    elif not isinstance(value, str):
      raise ValueError(f'{path}, line {i}: field {field!r} holds {type(value).__name__}, not text')
    else:
      docs.append(value)
  return docs


def _key(path: str, field: str, tokenizer: str, vocab_size: int) -> str:
  tok = pretrained.fingerprint(tokenizer) if tokenizer != 'bpe' else f'bpe-{vocab_size}'
  inputs = dict(format=FORMAT, file=_sha256(path), field=field, tokenizer=tok)
  return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def prepare_text(path: str, *, field: str = 'text', tokenizer: str = 'bpe', vocab_size: int = 8192,
                 cache_dir: str, progress: bool = True) -> TextData:
  """Tokenize (once) or reuse the corpus at `path`; see the module docstring."""
  out_dir = os.path.join(cache_dir, f'text-{_key(path, field, tokenizer, vocab_size)}')
  meta_path = os.path.join(out_dir, 'meta.json')
  if not os.path.isfile(meta_path):
    _build(path, out_dir, cache_dir, field=field, tokenizer=tokenizer, vocab_size=vocab_size, progress=progress)
  with open(meta_path, encoding='utf-8') as f:
    meta = json.load(f)
  return TextData(os.path.join(out_dir, 'train_tokens.npy'), meta['eos_id'], tokenizer,
                  os.path.join(out_dir, 'tokenizer.json'))


def _build(path, out_dir, cache_dir, *, field, tokenizer, vocab_size, progress):
  docs = read_documents(path, field)
  texts = [t for d in docs for t in ([d] if isinstance(d, str) else [text for _, text in d])]
  if tokenizer == 'bpe':
    tok = tokenizer_lib.train_bpe(texts, vocab_size=vocab_size, cache_dir=os.path.join(cache_dir, 'tokenizers'))
  else:
    tok = pretrained.load_tokenizer(tokenizer)
  if any(not isinstance(d, str) for d in docs) and tok.chat_template is None and tokenizer != 'bpe':
    raise ValueError(f"{path}: 'messages' need a chat template, and data.tokenizer={tokenizer} has none")
  stream = []
  bar = runtime.progress_bar(progress, 0, len(docs), desc=f'tokenizing {os.path.basename(path)}')
  with bar:
    for start in range(0, len(docs), 256):
      block = docs[start:start + 256]
      flat = [d if isinstance(d, str) else None for d in block]
      encoded = iter(tok.encode_batch([t for t in flat if t is not None]))
      for doc in block:
        if isinstance(doc, str):
          stream += next(encoded)
        else:  # a chat, in the tokenizer's template
          stream += tok.chat([(role, tok.encode(text)) for role, text in doc])
        stream.append(tok.eos_id)
      bar.update(len(block))
  tmp = f'{out_dir}.tmp-{os.getpid()}'
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  np.save(os.path.join(tmp, 'train_tokens.npy'), np.asarray(stream, np.uint16 if tok.vocab_size <= 1 << 16 else np.int32))
  if tokenizer == 'bpe':
    tok.save(os.path.join(tmp, 'tokenizer.json'))
  runtime.write_atomically(os.path.join(tmp, 'meta.json'), json.dumps(dict(
      source=os.path.realpath(path), field=field, tokenizer=tokenizer, eos_id=tok.eos_id, documents=len(docs),
      num_tokens=len(stream)), indent=1))
  try:
    os.replace(tmp, out_dir)  # atomic; fails if another process finished the same entry first
  except OSError:
    if not os.path.isfile(os.path.join(out_dir, 'meta.json')):
      raise
    shutil.rmtree(tmp, ignore_errors=True)
