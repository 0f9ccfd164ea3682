"""Trunk hidden states cached on disk, so that training only the MTP heads skips the trunk.

With the trunk frozen (`train.trainable` other than 'all'), the trunk's output h^0 of a record is
a pure function of its tokens and the trunk's parameters, and the heads and the detached teacher
read nothing else of the trunk: the main head's logits are one final norm and unembedding of h^0
(docs/design.md, "Trunk-state cache"). `TrunkCache` computes h^0 once per (trunk parameters, data)
into one `.npy` file per split and every run on that trunk and data (each row of a sweep, each
seed, each looped stage) reads its records' states from it.

A cache directory holds `meta.json` (the inputs it was built from, and their hash), `train.npy`
and `eval.npy` ([records, T, D]; bfloat16 is stored as its uint16 bits) and `<split>.rows`, the
number of records written so far: an interrupted build continues where it stopped (row_cache.py).
With `teacher` set (teacher_cache.py), the main head's teacher is built next, from these states,
and each record carries it too.
"""

import hashlib
import os

import jax
import numpy as np
from flax import nnx

from mtpd_jax import runtime
from mtpd_jax.harness import row_cache

FORMAT = 'trunk-cache/v1'
DTYPES = ('float32', 'bfloat16')
SPLITS = ('train', 'eval')
# Fields of config.data that do not change which tokens a record holds.
_DATA_FIELDS_WITHOUT_EFFECT = ('batch_size', 'shuffle', 'cache_dir')
_MODEL_FIELDS_WITHOUT_EFFECT = ('remat', 'max_seq_len', 'num_mtp_heads')


TrunkCacheError = row_cache.CacheError


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


class CachedStates:
  """A record source whose records also carry `trunk_hidden` [T, D], read from a built cache."""

  def __init__(self, source, cache: 'TrunkCache', split: str):
    self.source, self.cache, self.split = source, cache, split

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    record = dict(self.source[i])
    record['trunk_hidden'] = np.asarray(self.cache.states(self.split)[i])
    if self.cache.teacher is not None:  # the main head's teacher over a head vocabulary (teacher_cache.py)
      record.update(self.cache.teacher.fields(self.split, i))
    return record


class TrunkCache:
  """The trunk-state cache of one run: `build` it from the trunk, then read records through `wrap`.

  `directory` '' puts it under `cache_root` as `trunk-<hash of its inputs>`; a directory a user
  names is checked against the inputs in its meta.json.
  """

  def __init__(self, config, cache_root: str):
    self.config, self.cache_root = config, cache_root
    self.directory: str | None = None
    self.inputs: dict | None = None
    self.teacher = None  # a teacher_cache.TeacherCache that reads these states, built after them
    self._files: row_cache.RowCache | None = None

  def wrap(self, source, split: str) -> CachedStates:
    return CachedStates(source, self, split)

  def states(self, split: str) -> np.ndarray:
    if self._files is None:
      raise RuntimeError('the trunk-state cache is read before TrunkCache.build')
    return self._files.array(split, 'states')

  def build(self, graphdef, params, sources: dict, *, progress: bool = True) -> str:
    """Resolve the directory and write every split's states that are not there yet; returns it.

    `sources`: the un-wrapped record source of each split. Process 0 writes; the others wait.
    """
    self.inputs = cache_inputs(self.config, trunk_digest(params))
    named = self.config.train.trunk_cache_dir
    self.directory = named or os.path.join(self.cache_root, f'trunk-{row_cache.key_of(self.inputs)}')
    self._files = row_cache.RowCache(self.directory, {'states': ('', self.config.train.trunk_cache_dtype)},
                                     what='trunk cache', setting='train.trunk_cache_dir')
    t, d = self.config.data.seq_len, self.config.model.dim
    shapes = {split: [len(src), t, d] for split, src in sources.items()}
    if jax.process_index() == 0:
      os.makedirs(self.directory, exist_ok=True)
      self._files.check_or_write_meta(self.inputs, shapes, kind='trunk states')
      forward = jax.jit(lambda p, tokens, seg: nnx.merge(graphdef, p).trunk_hidden(tokens, seg))

      for split, source in sources.items():
        def compute(start, stop, source=source):
          records = [source[i] for i in range(start, stop)]
          tokens = np.stack([r['inputs'] for r in records])
          seg = np.stack([r['segment_ids'] for r in records])
          return {'states': np.asarray(jax.device_get(forward(params, tokens, seg)), np.float32)}
        self._files.build_split(split, {'states': shapes[split]}, compute, block=self.config.data.batch_size,
                                progress=progress, desc=f'trunk cache ({split} records)')
    runtime.sync_processes('trunk_cache')
    if self.teacher is not None:
      self.teacher.build(graphdef, params, sources, progress=progress)
    return self.directory
