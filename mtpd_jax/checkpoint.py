"""The one orbax seam: the train state and the grain iterator, saved together, atomically.

Orbax writes each step into a temporary directory and renames it when complete, so a kill
mid-save leaves the previous checkpoint intact; `max_to_keep` only prunes after a newer one
has been finalised.
"""

import contextlib
import errno
import gc
import logging
import math
import os
import shutil
import sys
import time

import grain
import jax
import orbax.checkpoint as ocp


def state_bytes(state) -> int:
  """Bytes of every array in `state` (concrete or abstract), summed over the global shapes."""
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, 'dtype'))


def _disk_full(e: BaseException | None) -> bool:
  """Whether `e` or an exception it wraps reports a full disk (tensorstore raises its own types)."""
  while e is not None:
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or 'No space left' in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def check_options(every_steps: int, max_to_keep: int) -> None:
  """Refuse checkpoint settings that would lose checkpoints, before anything is written."""
  if not isinstance(max_to_keep, int) or max_to_keep < 1:
    raise ValueError(f'ckpt.max_to_keep={max_to_keep!r} must be an int >= 1: fewer would delete every '
                     'checkpoint, the ones already in the workdir included')
  if not isinstance(every_steps, int) or every_steps < 0:
    raise ValueError(f'ckpt.every_steps={every_steps!r} must be an int >= 0 (0 = only the last step '
                     'and a preemption save)')


@contextlib.contextmanager
def _quiet_logs():
  """Orbax and tensorstore log an error with a traceback per array of a damaged checkpoint; the
  caller reports the damage once, so their logs are held back while it tries."""
  loggers = [logging.getLogger(n) for n in ('absl', 'orbax', 'asyncio', 'jax')]
  levels = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(logging.CRITICAL + 1)
  try:
    yield
  finally:
    gc.collect()  # asyncio logs a failed task's error when the task is collected: do that now
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)


def _drop_stray_read_errors() -> None:
  """When a restore fails, reads still in flight in tensorstore complete into orbax's closed event
  loop, and each prints 'RuntimeError: Event loop is closed' as an unraisable error; drop those."""
  if getattr(sys.unraisablehook, 'drops_stray_reads', False):
    return
  previous = sys.unraisablehook

  def hook(args):
    if not (args.exc_type is RuntimeError and str(args.exc_value) == 'Event loop is closed'):
      previous(args)
  hook.drops_stray_reads = True
  sys.unraisablehook = hook


class Checkpointer:
  """Saves {state, data iterator} every `every_steps` (and on demand); restores the latest."""

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int):
    check_options(every_steps, max_to_keep)
    self.directory, self.every_steps, self.max_to_keep = os.path.abspath(directory), every_steps, max_to_keep
    self.manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(self.directory, options=options, item_names=('state', 'data', 'meta'))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def check_free_space(self, abstract_state) -> None:
    """Refuse to start when the disk cannot hold the checkpoints still to come (one in flight
    beside the kept ones); raises OSError(ENOSPC) naming both sizes."""
    need = state_bytes(abstract_state) * max(1, self.max_to_keep + 1 - len(self.all_steps()))
    free = shutil.disk_usage(self.directory).free
    if free < need:
      raise OSError(errno.ENOSPC, f'{self.directory} has {free / 2**20:.1f} MiB free, but the checkpoints of '
                                  f'this run need about {need / 2**20:.1f} MiB; free space or use another --workdir')

  def save(self, step: int, state, iterator=None, meta: dict | None = None) -> None:
    """Save and wait until the checkpoint is final; a full disk raises OSError(ENOSPC), and the
    newest earlier checkpoint stays intact (orbax renames a step into place only when complete).
    `meta`: a small JSON dict that belongs to the state (a head vocabulary's ids), saved with it."""
    items = {'state': ocp.args.StandardSave(state)}
    if iterator is not None:
      items['data'] = grain.checkpoint.CheckpointSave(iterator)
    if meta is not None:
      items['meta'] = ocp.args.JsonSave(meta)
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if not _disk_full(e):
        raise
      kept = [s for s in self.all_steps() if s != step]
      raise OSError(errno.ENOSPC, f'disk full while writing checkpoint {step} in {self.directory}; '
                                  f'the newest complete checkpoint ({kept[-1] if kept else None}) is intact: '
                                  'free space and rerun to resume') from e

  def restore(self, step: int, abstract_state, iterator=None):
    """The state at `step` (placed per the shardings in `abstract_state`); `iterator` is rewound in place."""
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    if iterator is not None:
      items['data'] = grain.checkpoint.CheckpointRestore(iterator)
    return self.manager.restore(step, args=ocp.args.Composite(**items))['state']

  def restore_meta(self, step: int) -> dict | None:
    """The `meta` saved with checkpoint `step` (None: it was saved without one)."""
    if not os.path.isdir(os.path.join(self.directory, str(step), 'meta')):
      return None
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def restore_data(self, step: int, iterator) -> None:
    """Rewind `iterator` in place to checkpoint `step`'s data position (without its state)."""
    self.manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iterator)))

  def restore_named(self, step: int, abstract_state):
    """`restore` for readers (evaluation): a damaged checkpoint raises a ValueError naming it and is
    left where it is; resuming the training run moves it aside and continues from an earlier one."""
    _drop_stray_read_errors()
    try:
      with _quiet_logs():
        return self.restore(step, abstract_state)
    except Exception as e:  # orbax and tensorstore raise many types for damaged files
      raise ValueError(f'checkpoint {step} in {self.directory} is unreadable ({type(e).__name__}: '
                       f'{str(e).splitlines()[0][:160] if str(e) else "damaged files"}); rerunning its training '
                       'command moves it aside and resumes from the newest readable one') from None

  def restore_latest_good(self, abstract_state, iterator=None):
    """(step, state) of the newest readable checkpoint, or (None, None) if there is none at all.

    An unreadable checkpoint (truncated or corrupted files) is moved aside to
    `<directory>.unreadable/` with a warning that names it and the one used instead; nothing is
    deleted. If every checkpoint is unreadable, raises RuntimeError.
    """
    steps = sorted(self.all_steps(), reverse=True)
    _drop_stray_read_errors()
    for i, step in enumerate(steps):
      try:
        with _quiet_logs():
          return step, self.restore(step, abstract_state, iterator)
      except Exception as e:  # orbax and tensorstore raise many types for damaged files
        fallback = steps[i + 1] if i + 1 < len(steps) else None
        aside = self._move_aside(step)
        logging.warning('checkpoint %d is unreadable (%s: %s); moved to %s; %s', step, type(e).__name__,
                        str(e).splitlines()[0][:200], aside,
                        f'falling back to checkpoint {fallback}' if fallback is not None else 'no other left')
    if steps:
      raise RuntimeError(f'no readable checkpoint in {self.directory}: steps {steps} were all damaged '
                         f'(moved to {self.directory}.unreadable/)')
    return None, None

  def _move_aside(self, step: int) -> str:
    self.manager.close()
    dest = os.path.join(f'{self.directory}.unreadable', f'{step}-{int(time.time())}')
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.move(os.path.join(self.directory, str(step)), dest)
    self.manager = self._open()
    return dest

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
