"""The frozen main head's teacher over a head vocabulary, computed once per training position.

With a frozen trunk the main head's logits at a position are a pure function of its cached trunk
state h^0 (trunk_cache.py), and the head-vocabulary loss reads only a little of them
(`head_vocab.Teacher`: the Top-N among the U head-vocabulary columns with their log-probabilities,
the argmax and the target's log-probability over all of V). `TeacherCache` computes that from the
cached states once, so a training step of MTP or MTP-D never forms the main head's [B, T, V]
logits, and an MTP-D step costs about what an MTP step costs (docs/design.md, "Head vocabulary").

It sits beside the trunk cache, in `<trunk cache directory>.teacher-<hash>`, with the same layout
(row_cache.py: meta.json, one file per split and array, `<split>.rows`) and the same keying: the
trunk cache's inputs (trunk parameters, model, records) and what the teacher adds to them, the
head vocabulary's ids, N and τ. Any change to those builds another; an interrupted build resumes.
"""

import hashlib
import os

import jax
import numpy as np
from flax import nnx

from mtpd_jax import head_vocab, runtime
from mtpd_jax.harness import row_cache

FORMAT = 'teacher-cache/v1'


def teacher_inputs(trunk_inputs: dict, ids_U, top_n: int | None, tau: float) -> dict:
  """Everything the cached teacher depends on."""
  ids = np.asarray(ids_U, np.int64)
  return dict(format=FORMAT, trunk_cache=trunk_inputs, head_vocab=hashlib.sha256(ids.tobytes()).hexdigest(),
              top_n=head_vocab.top_n(len(ids), top_n), tau=float(tau))


class TeacherCache:
  """The teacher of one frozen trunk, head vocabulary and Top-N: `build` after the trunk cache,
  then `fields` gives a record's `teacher_*` arrays (trunk_cache.CachedStates adds them)."""

  def __init__(self, trunk, ids_U, *, top_n: int | None, tau: float):
    self.trunk, self.ids_U, self.tau = trunk, np.asarray(ids_U, np.int32), float(tau)
    self.n = head_vocab.top_n(len(self.ids_U), top_n)
    self.top_n = top_n
    self.directory: str | None = None
    idx_dtype = 'uint16' if len(self.ids_U) <= 1 << 16 else 'int32'
    self._arrays = {'idx': ('.idx', idx_dtype), 'logp': ('.logp', 'float32'),
                    'argmax': ('.argmax', 'int32'), 'target_logp': ('.target_logp', 'float32')}
    self._files: row_cache.RowCache | None = None

  def fields(self, split: str, i: int) -> dict[str, np.ndarray]:
    if self._files is None:
      raise RuntimeError('the teacher cache is read before TeacherCache.build')
    out = {f'teacher_{name}': np.asarray(self._files.array(split, name)[i]) for name in self._arrays}
    out['teacher_idx'] = out['teacher_idx'].astype(np.int32)
    return out

  def build(self, graphdef, params, sources: dict, *, progress: bool = True) -> str:
    """Write every split's teacher that is not there yet, from the built trunk cache; returns the directory."""
    inputs = teacher_inputs(self.trunk.inputs, self.ids_U, self.top_n, self.tau)
    self.directory = f'{self.trunk.directory}.teacher-{row_cache.key_of(inputs)}'
    self._files = row_cache.RowCache(self.directory, self._arrays, what='teacher cache',
                                     setting='train.trunk_cache_dir')
    t = self.trunk.config.data.seq_len
    shapes = {split: {'idx': [len(src), t, self.n], 'logp': [len(src), t, self.n], 'argmax': [len(src), t],
                      'target_logp': [len(src), t]} for split, src in sources.items()}
    if jax.process_index() == 0:
      os.makedirs(self.directory, exist_ok=True)
      self._files.check_or_write_meta(inputs, shapes, kind='a teacher')
      ids_U, n, tau = self.ids_U, self.n, self.tau

      @jax.jit
      def teacher(p, h_BxTxD, targets_BxT):
        logits_BxTxV = nnx.merge(graphdef, p).logits(h_BxTxD.astype(np.float32))
        return head_vocab.teacher(logits_BxTxV, targets_BxT, ids_U, n=n, tau=tau)._asdict()

      for split, source in sources.items():
        def compute(start, stop, split=split, source=source):
          targets = np.stack([source[i]['targets'] for i in range(start, stop)])
          out = jax.device_get(teacher(params, np.asarray(self.trunk.states(split)[start:stop]), targets))
          return {'idx': out['idx_BxTxN'], 'logp': out['logp_BxTxN'], 'argmax': out['argmax_BxT'],
                  'target_logp': out['target_logp_BxT']}
        self._files.build_split(split, shapes[split], compute, block=self.trunk.config.data.batch_size,
                                progress=progress, desc=f'teacher cache ({split} records)')
    runtime.sync_processes('teacher_cache')
    return self.directory
