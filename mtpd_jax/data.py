"""Token sources and grain pipelines (numpy only; jax never enters this file).

A record is one window of T+1 tokens of a document-packed stream (documents joined by an EOS
token), returned as `inputs` (tokens 0..T-1), `targets` (tokens 1..T) and their document ids
`segment_ids` / `target_segment_ids`, so losses can mask targets that cross a document boundary.
"""

import os

import grain
import numpy as np

RECORD_KEYS = ('inputs', 'targets', 'segment_ids', 'target_segment_ids')


def pack_window(window: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
  """Split a window of T+1 tokens into inputs/targets with document ids (EOS ends its document)."""
  window = np.asarray(window, np.int32)
  # Document id of token j = 1 + number of EOS tokens strictly before j.
  seg = 1 + np.concatenate([[0], np.cumsum(window[:-1] == eos_id)]).astype(np.int32)
  return {'inputs': window[:-1], 'targets': window[1:],
          'segment_ids': seg[:-1], 'target_segment_ids': seg[1:]}


def load_token_file(path: str, vocab_size: int | None = None) -> np.ndarray:
  """A 1-D integer `.npy` array, memory-mapped and never unpickled; every message names the file.

  Ids are checked against [0, vocab_size) here, when the run starts, not when a batch reaches them.
  """
  if os.path.isdir(path):
    raise IsADirectoryError(f'token file {path} is a directory; name the .npy file of token ids inside it')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'token file {path} does not exist')
  with open(path, 'rb') as f:
    magic = f.read(6)
  if magic != b'\x93NUMPY':  # np.load would call any other file "pickled" and suggest unpickling it
    raise ValueError(f'token file {path} is not a .npy array file (save token ids with numpy.save)')
  try:
    tokens = np.load(path, mmap_mode='r', allow_pickle=False)
  except ValueError as e:
    reason = ('holds Python objects, not token ids' if 'object' in str(e) or 'pickle' in str(e)
              else 'is truncated: shorter than its header says' if 'mmap length' in str(e)
              else f'has a damaged .npy header ({e})')
    raise ValueError(f'token file {path} {reason}') from None
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f'token file {path}: expected a 1-D integer array, got {tokens.dtype}{tokens.shape}')
  if tokens.size:
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0:
      raise ValueError(f'token file {path} holds id {lo}; token ids must be >= 0')
    if vocab_size is not None and hi >= vocab_size:
      raise ValueError(f'token file {path} holds id {hi} >= vocab_size {vocab_size}')
  return tokens


class PackedTokens:
  """Non-overlapping windows of `seq_len + 1` tokens over a 1-D token file (memory-mapped `.npy`).

  Records [start, stop) of the file are served, so one file yields a train and a held-out split.
  """

  def __init__(self, path: str, seq_len: int, eos_id: int, vocab_size: int | None = None,
               split: tuple[float, float] = (0.0, 1.0)):
    self.tokens = load_token_file(path, vocab_size)
    self.seq_len, self.eos_id = seq_len, eos_id
    total = max((len(self.tokens) - 1) // seq_len, 0)
    self.start, self.stop = int(total * split[0]), int(total * split[1])
    if self.stop <= self.start:
      raise ValueError(f'token file {path} has too few tokens ({len(self.tokens)}) for seq_len {seq_len}')

  def __len__(self):
    return self.stop - self.start

  def __getitem__(self, i):
    begin = (self.start + i) * self.seq_len
    return pack_window(self.tokens[begin:begin + self.seq_len + 1], self.eos_id)


class SyntheticSource:
  """A learnable stream: documents are arithmetic progressions mod (V-1), EOS id 0 between them.

  Two tokens of a document determine the rest, so main and MTP heads can all approach zero loss;
  record i depends only on (seed, i), so the source is random-access and reproducible.
  """

  def __init__(self, vocab_size: int, seq_len: int, num_records: int = 4096, seed: int = 0,
               doc_len: tuple[int, int] = (8, 48), max_stride: int = 4):
    self.vocab_size, self.seq_len, self.num_records, self.seed = vocab_size, seq_len, num_records, seed
    self.doc_len, self.max_stride, self.eos_id = doc_len, max_stride, 0

  def __len__(self):
    return self.num_records

  def __getitem__(self, i):
    rng = np.random.default_rng([self.seed, int(i)])
    out, m = [], self.vocab_size - 1
    while len(out) < self.seq_len + 1:
      length = rng.integers(*self.doc_len)
      start, stride = rng.integers(m), rng.integers(1, self.max_stride + 1)
      out.extend((1 + (start + stride * np.arange(length)) % m).tolist())
      out.append(self.eos_id)
    return pack_window(np.array(out[:self.seq_len + 1]), self.eos_id)


class _ProcessRows:
  """Process p's share of a record stream: rows [p*L, (p+1)*L) of every global batch of P*L rows.

  The global batch is thus the same whatever the process count, and so is the training run.
  """

  def __init__(self, stream, local_batch: int, process_index: int, process_count: int):
    self.stream, self.local, self.p, self.count = stream, local_batch, process_index, process_count

  def __len__(self):
    return len(self.stream) // (self.count * self.local) * self.local

  def __getitem__(self, j):
    step, row = divmod(j, self.local)
    return self.stream[(step * self.count + self.p) * self.local + row]


def make_iterator(source, *, global_batch: int, seed: int, shuffle: bool = True,
                  process_index: int = 0, process_count: int = 1, repeat: bool = True):
  """A checkpointable grain iterator over this process's rows of each global batch."""
  if global_batch % process_count:
    raise ValueError(f'batch size {global_batch} is not divisible by {process_count} processes')
  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  if repeat:
    ds = ds.repeat(None)  # each epoch is reshuffled
  local = global_batch // process_count
  rows = grain.MapDataset.source(_ProcessRows(ds, local, process_index, process_count))
  return iter(rows.batch(local, drop_remainder=True).to_iter_dataset())
