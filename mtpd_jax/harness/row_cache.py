"""A cache directory of per-record arrays on disk, built a block of records at a time, resumably.

The trunk-state cache (trunk_cache.py) and the teacher cache (teacher_cache.py) are both one: a
directory holds `meta.json` (the inputs it was built from, their hash and every array's shape),
one `.npy` file per split and array (`<split><suffix>.npy`, a header then a body filled block by
block) and `<split>.rows`, the number of records complete in every array of that split. A build
killed partway leaves the rows it finished; the next build continues from them, and nothing reads
a split as complete before its `.rows` says so. A file shorter than its header, or whose shape
is not the one meta.json records, is refused in one line that names it.
"""

import hashlib
import json
import os
import shutil
from collections.abc import Callable

import ml_dtypes
import numpy as np

from mtpd_jax import runtime


class CacheError(ValueError):
  """A cache that cannot be used as it is; the message says what to do."""


def key_of(inputs: dict) -> str:
  return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def differences(a: dict, b: dict, prefix: str = '') -> list[str]:
  """The dotted names of the fields on which two inputs dicts differ."""
  out = []
  for k in sorted(set(a) | set(b)):
    x, y = a.get(k), b.get(k)
    if isinstance(x, dict) and isinstance(y, dict):
      out += differences(x, y, f'{prefix}{k}.')
    elif json.dumps(x) != json.dumps(y):
      out.append(f'{prefix}{k}' if k != 'trunk' else 'the trunk parameters')
  return out


def _stored(dtype: str):
  """The on-disk dtype of an array kind: bfloat16 is stored as its uint16 bits."""
  return np.dtype(np.uint16) if dtype == 'bfloat16' else np.dtype(dtype)


class RowCache:
  """The files of one cache directory.

  `arrays`: name -> (file suffix, dtype name); `what` names the cache in messages ('trunk cache')
  and `setting` the config field that names another directory (train.trunk_cache_dir).
  """

  def __init__(self, directory: str, arrays: dict[str, tuple[str, str]], *, what: str, setting: str):
    self.directory, self.arrays, self.what, self.setting = directory, arrays, what, setting
    self._open: dict[tuple[str, str], np.ndarray] = {}

  def path(self, split: str, name: str) -> str:
    return os.path.join(self.directory, split + self.arrays[name][0] + '.npy')

  def _rows_path(self, split: str) -> str:
    return os.path.join(self.directory, split + '.rows')

  def read_meta(self) -> dict:
    path = os.path.join(self.directory, 'meta.json')
    try:
      with open(path) as f:
        return json.load(f)
    except ValueError as e:
      raise CacheError(f'{path} is not valid JSON ({e}); delete {self.directory} to rebuild the {self.what}') from None

  def check_or_write_meta(self, inputs: dict, shapes: dict[str, dict[str, list[int]]], *, kind: str) -> None:
    """Refuse a directory built from other inputs (or not a cache); write meta.json to a new one.
    `shapes`: split -> array name -> shape; `kind` says what the arrays are, for the refusal."""
    meta_path = os.path.join(self.directory, 'meta.json')
    if os.path.exists(meta_path):
      diffs = differences(self.read_meta().get('inputs', {}), inputs)
      if diffs:
        raise CacheError(f'{self.directory} holds {kind} of another model or data (differs in: '
                         f'{", ".join(diffs)}); name another {self.setting} or delete it')
      return
    if os.path.isdir(self.directory) and os.listdir(self.directory):
      raise CacheError(f'{self.directory} is not empty and holds no meta.json, so it is not a {self.what}; '
                       f'name an empty or new {self.setting}')
    runtime.write_atomically(meta_path, json.dumps(dict(inputs=inputs, key=key_of(inputs), shapes=shapes),
                                                   indent=1, sort_keys=True))

  def rows_done(self, split: str) -> int:
    try:
      with open(self._rows_path(split)) as f:
        return int(f.read().strip() or 0)
    except FileNotFoundError:
      return 0

  def array(self, split: str, name: str) -> np.ndarray:
    """The array, memory-mapped and checked against meta.json (bfloat16 viewed back from its bits)."""
    if (split, name) not in self._open:
      path = self.path(split, name)
      try:
        array = np.load(path, mmap_mode='r', allow_pickle=False)
      except ValueError as e:
        reason = 'is truncated' if 'mmap length' in str(e) else f'has a damaged header ({e})'
        raise CacheError(f'{self.what} file {path} {reason}; delete {self.directory} to rebuild it') from None
      except FileNotFoundError:
        raise CacheError(f'{self.what} file {path} is missing; delete {self.directory} to rebuild it') from None
      want = self.read_meta()['shapes'][split]
      want = want[name] if isinstance(want, dict) else want
      if list(array.shape) != want:
        raise CacheError(f'{self.what} file {path} holds {array.shape}, its meta.json says {tuple(want)}; '
                         f'delete {self.directory} to rebuild it')
      self._open[split, name] = array.view(ml_dtypes.bfloat16) if self.arrays[name][1] == 'bfloat16' else array
    return self._open[split, name]

  def build_split(self, split: str, shapes: dict[str, tuple[int, ...]], compute: Callable[[int, int], dict],
                  *, block: int, progress: bool, desc: str) -> None:
    """Fill every array of `split` (shapes: name -> [records, ...]) from the rows `.rows` says are
    missing, `block` records at a time: `compute(start, stop)` gives each array's rows."""
    n = next(iter(shapes.values()))[0]
    done = self.rows_done(split)
    if done >= n:
      for name in shapes:
        self.array(split, name)  # complete files: check they can be read
      return
    row_bytes = {name: int(np.prod(shape[1:])) * _stored(self.arrays[name][1]).itemsize
                 for name, shape in shapes.items()}
    if done == 0 or not all(os.path.exists(self.path(split, name)) for name in shapes):
      done, free = 0, shutil.disk_usage(self.directory).free
      need = n * sum(row_bytes.values())
      if free < need + (64 << 20):
        raise CacheError(f'the {self.what} needs {need / 2**30:.2f} GiB for {split} in {self.directory}, which '
                         f'has {free / 2**30:.2f} GiB free; free space or name another {self.setting}')
      for name, shape in shapes.items():
        with open(self.path(split, name), 'wb') as f:  # the .npy header, then a sparse body for the rows
          header = np.lib.format.header_data_from_array_1_0(np.empty((0,), _stored(self.arrays[name][1])))
          np.lib.format.write_array_header_1_0(f, {**header, 'shape': tuple(shape)})
          f.truncate(f.tell() + n * row_bytes[name])
    offsets = {name: np.load(self.path(split, name), mmap_mode='r').offset for name in shapes}
    bar = runtime.progress_bar(progress, done, n, desc=desc)
    files = {}
    try:
      with bar:
        files = {name: open(self.path(split, name), 'r+b') for name in shapes}
        for start in range(done, n, block):
          stop = min(start + block, n)
          rows = compute(start, stop)
          for name, f in files.items():
            value = np.asarray(rows[name])
            if self.arrays[name][1] == 'bfloat16':
              value = value.astype(ml_dtypes.bfloat16).view(np.uint16)
            f.seek(offsets[name] + start * row_bytes[name])
            f.write(np.ascontiguousarray(value, _stored(self.arrays[name][1])).tobytes())
            f.flush()
            os.fsync(f.fileno())
          runtime.write_atomically(self._rows_path(split), str(stop))
          bar.update(stop - start)
    except OSError as e:
      raise CacheError(f'writing the {self.what} in {self.directory} failed ({e.strerror}); the rows written so '
                       'far are kept and a rerun continues from them') from None
    finally:
      for f in files.values():
        f.close()
