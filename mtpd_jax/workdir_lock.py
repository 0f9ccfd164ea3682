"""An advisory lock on a workdir, so that one process at a time trains or evaluates it.

The lock is `flock` on `<workdir>/.lock`, which holds the holder's pid and host. The kernel
releases an flock when its process ends in any way (SIGKILL included), so a lock file that is
still there but not locked was left by a dead process: it is taken over with one warning. A clean
release removes the file, so a workdir looks as it did before. Locks are re-entrant within a
process (a sweep point holds its workdir while `train_and_evaluate` takes it again). In a
multi-process run only process 0 holds it.
"""

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time

LOCK_NAME = '.lock'

_held: dict[str, int] = {}  # lock path -> nesting depth in this process


class WorkdirLocked(OSError):
  """Another live process holds the workdir."""

  def __init__(self, message: str):
    super().__init__(errno.EBUSY, message)

  def __str__(self) -> str:
    return self.strerror


def _holder(fd: int) -> str:
  """'pid P on HOST' from an open lock file, or '' when it is empty."""
  os.lseek(fd, 0, os.SEEK_SET)
  pid, _, host = os.read(fd, 256).decode(errors='replace').strip().partition(' ')
  return f'pid {pid} on {host or "?"}' if pid else ''


def _acquire(path: str, workdir: str, wait: bool) -> int:
  """An fd of `path`, exclusively flocked; raises WorkdirLocked naming the holder (or waits)."""
  announced = False
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _holder(fd) or 'another process'
      os.close(fd)
      if not wait:
        raise WorkdirLocked(f'{workdir} is in use by {holder} (lock file {path}); wait for it to end, '
                            'or stop it, before running on this workdir') from None
      if not announced:
        print(f'waiting for {holder}, which holds {workdir}', flush=True)
        announced = True
      time.sleep(1.0)
      continue
    try:  # a releasing holder unlinks the file: a lock on that old inode guards nothing
      same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
      same = False
    if same:
      return fd
    os.close(fd)


@contextlib.contextmanager
def hold(workdir: str, *, create: bool = True, wait: bool = False, enabled: bool | None = None):
  """Hold `workdir`'s lock for the body; refuses (WorkdirLocked) if a live process holds it.

  create: make the workdir if it does not exist (else a missing workdir is not locked at all).
  wait: block until the holder is done instead of refusing (a shared base model).
  enabled: default `jax.process_index() == 0`.
  """
  if enabled is None:
    import jax  # pylint: disable=import-outside-toplevel
    enabled = jax.process_index() == 0
  if not enabled or (not create and not os.path.isdir(workdir)):
    yield
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.realpath(os.path.join(workdir, LOCK_NAME))
  if path in _held:
    _held[path] += 1
    try:
      yield
    finally:
      _held[path] -= 1
    return
  fd = _acquire(path, workdir, wait)
  try:
    stale = _holder(fd)
    if stale:
      logging.warning('%s: taking over a stale lock of %s, which is gone', workdir, stale)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{os.getpid()} {socket.gethostname()}\n'.encode(), 0)
    _held[path] = 1
    yield
  finally:
    _held.pop(path, None)
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)  # before unlocking: a waiter that then gets the old inode retries (see _acquire)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
