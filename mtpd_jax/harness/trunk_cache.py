"""Trunk hidden states cached on disk, so that training only the MTP heads skips the trunk.

With the trunk frozen (`train.trainable` other than 'all'), the trunk's output h^0 of a record is
a pure function of its tokens and the trunk's parameters, and the heads and the detached teacher
read nothing else of the trunk: the main head's logits are one final norm and unembedding of h^0
(docs/design.md, "Trunk-state cache"). `TrunkCache` computes h^0 once per (trunk parameters, data)
into one `.npy` file per split and every run on that trunk and data (each row of a sweep, each
seed, each looped stage) reads its records' states from it.

A cache directory holds `meta.json` (the inputs it was built from, and their hash), `train.npy`
and `eval.npy` ([records, T, D]; bfloat16 is stored as its uint16 bits) and `<split>.rows`, the
number of records written so far: an interrupted build continues where it stopped.
"""

import hashlib
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from mtpd_jax import runtime

FORMAT = 'trunk-cache/v1'
DTYPES = ('float32', 'bfloat16')
SPLITS = ('train', 'eval')
# Fields of config.data that do not change which tokens a record holds.
_DATA_FIELDS_WITHOUT_EFFECT = ('batch_size', 'shuffle', 'cache_dir')
_MODEL_FIELDS_WITHOUT_EFFECT = ('remat', 'max_seq_len')


class TrunkCacheError(ValueError):
  """A cache that cannot be used as it is; the message says what to do."""


def trunk_digest(params: nnx.State) -> str:
  """sha256 over every parameter outside the MTP heads (path, dtype, shape and bytes)."""
  h = hashlib.sha256()
  for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda x: jax.tree_util.keystr(x[0])):
    name = jax.tree_util.keystr(path)
    if name.startswith("['mtp_heads']"):
      continue
    value = np.asarray(jax.device_get(leaf))
    h.update(f'{name}:{value.dtype}:{value.shape};'.encode())
    h.update(np.ascontiguousarray(value).tobytes())
  return h.hexdigest()


def cache_inputs(config, digest: str) -> dict:
  """Everything a cache's contents depend on: trunk parameters, model, records, storage dtype."""
  model = {k: v for k, v in config.model.to_dict().items() if k not in _MODEL_FIELDS_WITHOUT_EFFECT}
  d = config.data.to_dict()
  records = {k: v for k, v in d.items() if k not in _DATA_FIELDS_WITHOUT_EFFECT}
  if d['source'] != 'synthetic':
    records.pop('seed')  # only the synthetic records depend on the data seed (the order never matters here)
  if d['source'] == 'tokens':  # the file itself, not only its name
    st = os.stat(d['train_path'])
    records['train_path'] = dict(path=os.path.realpath(d['train_path']), size=st.st_size, mtime_ns=st.st_mtime_ns)
  return dict(format=FORMAT, trunk=digest, model=model, data=records, dtype=config.train.trunk_cache_dtype)


def _key(inputs: dict) -> str:
  return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _differences(a: dict, b: dict, prefix: str = '') -> list[str]:
  out = []
  for k in sorted(set(a) | set(b)):
    x, y = a.get(k), b.get(k)
    if isinstance(x, dict) and isinstance(y, dict):
      out += _differences(x, y, f'{prefix}{k}.')
    elif json.dumps(x) != json.dumps(y):
      out.append(f'{prefix}{k}' if k != 'trunk' else 'the trunk parameters')
  return out


class CachedStates:
  """A record source whose records also carry `trunk_hidden` [T, D], read from a built cache."""

  def __init__(self, source, cache: 'TrunkCache', split: str):
    self.source, self.cache, self.split = source, cache, split

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    record = dict(self.source[i])
    record['trunk_hidden'] = np.asarray(self.cache.states(self.split)[i])
    return record


class TrunkCache:
  """The trunk-state cache of one run: `build` it from the trunk, then read records through `wrap`.

  `directory` '' puts it under `cache_root` as `trunk-<hash of its inputs>`; a directory a user
  names is checked against the inputs in its meta.json.
  """

  def __init__(self, config, cache_root: str):
    self.config, self.cache_root = config, cache_root
    self.directory: str | None = None
    self._arrays: dict[str, np.ndarray] = {}

  def wrap(self, source, split: str) -> CachedStates:
    return CachedStates(source, self, split)

  def _path(self, split: str, suffix: str = '.npy') -> str:
    return os.path.join(self.directory, split + suffix)

  def states(self, split: str) -> np.ndarray:
    if split not in self._arrays:
      if self.directory is None:
        raise RuntimeError('the trunk-state cache is read before TrunkCache.build')
      self._arrays[split] = self._open(split)
    return self._arrays[split]

  def _open(self, split: str) -> np.ndarray:
    path = self._path(split)
    try:
      array = np.load(path, mmap_mode='r', allow_pickle=False)
    except ValueError as e:
      reason = 'is truncated' if 'mmap length' in str(e) else f'has a damaged header ({e})'
      raise TrunkCacheError(f'trunk cache file {path} {reason}; delete {self.directory} to rebuild it') from None
    meta = self._read_meta()
    if list(array.shape) != meta['shapes'][split]:
      raise TrunkCacheError(f'trunk cache file {path} holds {array.shape}, its meta.json says '
                            f'{tuple(meta["shapes"][split])}; delete {self.directory} to rebuild it')
    return array.view(ml_dtypes.bfloat16) if meta['inputs']['dtype'] == 'bfloat16' else array

  def _read_meta(self) -> dict:
    path = os.path.join(self.directory, 'meta.json')
    try:
      with open(path) as f:
        return json.load(f)
    except ValueError as e:
      raise TrunkCacheError(f'{path} is not valid JSON ({e}); delete {self.directory} to rebuild the cache') from None

  def build(self, graphdef, params, sources: dict, *, progress: bool = True) -> str:
    """Resolve the directory and write every split's states that are not there yet; returns it.

    `sources`: the un-wrapped record source of each split. Process 0 writes; the others wait.
    """
    inputs = cache_inputs(self.config, trunk_digest(params))
    named = self.config.train.trunk_cache_dir
    self.directory = named or os.path.join(self.cache_root, f'trunk-{_key(inputs)}')
    shapes = {split: [len(src), self.config.data.seq_len, self.config.model.dim] for split, src in sources.items()}
    if jax.process_index() == 0:
      self._check_or_write_meta(inputs, shapes)
      forward = jax.jit(lambda p, tokens, seg: nnx.merge(graphdef, p).trunk_hidden(tokens, seg))
      for split, source in sources.items():
        self._build_split(split, source, forward, params, progress)
    runtime.sync_processes('trunk_cache')
    return self.directory

  def _check_or_write_meta(self, inputs: dict, shapes: dict) -> None:
    meta_path = os.path.join(self.directory, 'meta.json')
    if os.path.exists(meta_path):
      meta = self._read_meta()
      diffs = _differences(meta.get('inputs', {}), inputs)
      if diffs:
        raise TrunkCacheError(f'{self.directory} holds trunk states of another model or data (differs in: '
                              f'{", ".join(diffs)}); name another train.trunk_cache_dir or delete it')
      return
    if os.path.isdir(self.directory) and os.listdir(self.directory):
      raise TrunkCacheError(f'{self.directory} is not empty and holds no meta.json, so it is not a trunk '
                            'cache; name an empty or new train.trunk_cache_dir')
    runtime.write_atomically(meta_path, json.dumps(dict(inputs=inputs, key=_key(inputs), shapes=shapes),
                                                   indent=1, sort_keys=True))

  def _rows_done(self, split: str) -> int:
    try:
      with open(self._path(split, '.rows')) as f:
        return int(f.read().strip() or 0)
    except FileNotFoundError:
      return 0

  def _build_split(self, split, source, forward, params, progress) -> None:
    n, t, d = len(source), self.config.data.seq_len, self.config.model.dim
    done = self._rows_done(split)
    if done >= n:
      self.states(split)  # a complete file: check it can be read
      return
    path = self._path(split)
    stored = np.uint16 if self.config.train.trunk_cache_dtype == 'bfloat16' else np.float32
    row_bytes = t * d * np.dtype(stored).itemsize
    if done == 0 or not os.path.exists(path):
      done, free = 0, shutil.disk_usage(self.directory).free
      if free < n * row_bytes + (64 << 20):
        raise TrunkCacheError(f'the trunk cache needs {n * row_bytes / 2**30:.2f} GiB for {split} in '
                              f'{self.directory}, which has {free / 2**30:.2f} GiB free; free space or '
                              'name another train.trunk_cache_dir')
      with open(path, 'wb') as f:  # the .npy header, then a sparse body that the rows below fill in
        header = np.lib.format.header_data_from_array_1_0(np.empty((0,), stored))
        np.lib.format.write_array_header_1_0(f, {**header, 'shape': (n, t, d)})
        f.truncate(f.tell() + n * row_bytes)
    offset = np.load(path, mmap_mode='r').offset
    rows = self.config.data.batch_size
    bar = runtime.progress_bar(progress, done, n, desc=f'trunk cache ({split} records)')
    try:
      with bar, open(path, 'r+b') as f:
        for start in range(done, n, rows):
          records = [source[i] for i in range(start, min(start + rows, n))]
          tokens = np.stack([r['inputs'] for r in records])
          seg = np.stack([r['segment_ids'] for r in records])
          h = np.asarray(jax.device_get(forward(params, tokens, seg)), np.float32)
          if stored is np.uint16:
            h = h.astype(ml_dtypes.bfloat16).view(np.uint16)
          f.seek(offset + start * row_bytes)
          f.write(np.ascontiguousarray(h).tobytes())
          f.flush()
          os.fsync(f.fileno())
          self._write_rows(split, start + len(records))
          bar.update(len(records))
    except OSError as e:
      raise TrunkCacheError(f'writing the trunk cache {path} failed ({e.strerror}); the rows written so far '
                            'are kept and a rerun continues from them') from None

  def _write_rows(self, split: str, rows: int) -> None:
    runtime.write_atomically(self._path(split, '.rows'), str(rows))
