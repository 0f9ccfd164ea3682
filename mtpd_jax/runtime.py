"""Host-side pieces of the training loop: the metrics log, the progress bar, preemption signals,
and atomic file writes."""

import json
import logging
import os
import signal
import sys
import tempfile
import threading
from typing import Any

import jax

class Preempted(Exception):
  """Training stopped on a signal after checkpointing `step`; rerunning the command resumes.

  In a multi-process run the processes have already left jax.distributed together
  (`leave_together`): the process should only exit.
  """

  def __init__(self, step: int, signum: int):
    super().__init__(f'stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved, '
                     'rerun the same command to resume')
    self.step, self.signum = step, signum


def _multi_process() -> bool:
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return jax.process_count() > 1 and distributed.global_state.client is not None


class PreemptionGuard:
  """SIGTERM/SIGINT ask the loop to checkpoint after the current step; a second signal exits at once.

  In a multi-process run SIGTERM is jax's preemption notice: jax.distributed.initialize installs its
  own SIGTERM handler, which tells every process, and `reached_preemption_sync_point(step)` is
  True on all of them at the same step, the first one that no process has passed yet. A SIGINT
  there is turned into that notice (the process sends itself SIGTERM); a second SIGTERM does
  nothing more (jax's handler stays), a second SIGINT exits at once.
  """

  def __init__(self):
    self.signum, self.step = None, 0
    self._previous = {}
    self._multi = False

  def __enter__(self):
    self._multi = _multi_process()
    if threading.current_thread() is threading.main_thread():  # handlers can only live there
      # Multi-process: SIGTERM stays with jax's handler; a Python one would replace it.
      for sig in (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    return False

  def _handle(self, signum, frame):
    if self.signum is not None:
      print(f'\nsecond {signal.Signals(signum).name}: exiting now, without a checkpoint', file=sys.stderr)
      os._exit(128 + signum)
    self.signum = signum
    print(f'\n{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping '
          '(send it again to exit at once)', file=sys.stderr, flush=True)
    if self._multi:
      os.kill(os.getpid(), signal.SIGTERM)  # to jax's notifier, which tells the other processes

  def requested(self) -> bool:
    """Whether to checkpoint and stop after step `self.step`: the same answer at the same step on
    every process. The loop sets `step` and asks after every step (the sync point needs each one)."""
    if not self._multi:
      return self.signum is not None
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    if multihost_utils.reached_preemption_sync_point(self.step):
      self.signum = self.signum or signal.SIGTERM
      return True
    return False


_barriers = [0]


def sync_processes(name: str, timeout_s: int = 1800) -> None:
  """Wait until every process gets here: a coordination-service barrier, not a device collective."""
  if _multi_process():
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    _barriers[0] += 1  # every process makes the same calls in the same order: the same names
    distributed.global_state.client.wait_at_barrier(f'mtpd_jax/{name}/{_barriers[0]}', timeout_s * 1000)


def leave_together() -> None:
  """Leave jax.distributed on every process together, before a stopped multi-process run exits.

  Process 0 hosts the coordination service. Were it to exit as soon as its own last barrier (the
  checkpoint's) returned, another process could still be waiting for that barrier's reply and fail
  with 'Socket closed'. jax.distributed.shutdown() is one more barrier, after which process 0 stops
  the service only once every process has left it.
  """
  if _multi_process():
    jax.distributed.shutdown()


class MetricsLog:
  """`metrics.jsonl` in the workdir (process 0 only), truncated to the resumed step on restart.

  A last line cut short (a crash while writing it) is dropped with one warning; an unreadable line
  before the last is refused naming the file and the line.
  """

  def __init__(self, path: str, resume_step: int):
    self.path = path
    self.enabled = jax.process_index() == 0
    if self.enabled and os.path.exists(path):
      with open(path, 'rb') as f:
        lines = f.read().split(b'\n')
      kept = []
      for i, line in enumerate(lines, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
          step = record['step']
        except (ValueError, KeyError, TypeError) as e:
          if any(rest.strip() for rest in lines[i:]):
            raise ValueError(f'{path}, line {i}: not a metrics record ({type(e).__name__}: {e}); '
                             'repair or delete that line to resume') from None
          logging.warning('%s, line %d: dropped a line cut short (%d bytes), written when the run was '
                          'stopped mid-write', path, i, len(line))
          continue
        if step <= resume_step:
          kept.append(line + b'\n')
      with open(path, 'wb') as f:
        f.writelines(kept)

  def write(self, record: dict[str, Any]) -> None:
    if self.enabled:
      with open(self.path, 'a') as f:
        f.write(json.dumps(record) + '\n')


def progress_bar(enabled: bool, start: int, total: int, desc: str = 'train'):
  import tqdm  # the terminal bar only; metrics.jsonl is the record
  return tqdm.tqdm(initial=start, total=total, disable=not enabled or jax.process_index() != 0,
                   dynamic_ncols=True, desc=desc)


def _created_mode() -> int:
  """The permissions open() gives a new file under the process's umask."""
  umask = os.umask(0)
  os.umask(umask)
  return 0o666 & ~umask


def chmod_as_created(path: str) -> None:
  """Give `path` the permissions open() would have created it with."""
  os.chmod(path, _created_mode())


def write_atomically(path: str, text: str) -> None:
  """`text` into `path` via a temporary file and a rename: readers see the old file or the new one."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.', prefix='.tmp-')
  os.fchmod(fd, _created_mode())  # mkstemp's file is private
  with os.fdopen(fd, 'w', encoding='utf-8') as f:
    f.write(text)
  os.replace(tmp, path)
