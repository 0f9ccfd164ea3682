"""Host-side pieces of the training loop: the metrics log, the progress bar, preemption signals,
and the workdir checks that keep a resumed run from mixing with another model's checkpoints."""

import json
import os
import signal
import sys
import threading
from typing import Any

import jax
import numpy as np

# Config fields that change the shape of the saved state: a workdir's checkpoints are only
# restorable by a config that agrees on all of them.
STATE_SHAPING_FIELDS = ('model', 'mtp.num_heads', 'train.trainable')


class Preempted(Exception):
  """Training stopped on a signal after checkpointing `step`; rerunning the command resumes."""

  def __init__(self, step: int, signum: int):
    super().__init__(f'stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved, '
                     'rerun the same command to resume')
    self.step, self.signum = step, signum


class PreemptionGuard:
  """SIGTERM/SIGINT ask the loop to checkpoint after the current step; a second signal exits at once."""

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # handlers can only live there
      for sig in (signal.SIGTERM, signal.SIGINT):
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

  def requested(self) -> bool:
    """True on every process once any process got a signal (all stop at the same step)."""
    flag = self.signum is not None
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      flag = bool(np.any(multihost_utils.process_allgather(np.array(flag))))
      self.signum = self.signum or (signal.SIGTERM if flag else None)
    return flag


class MetricsLog:
  """`metrics.jsonl` in the workdir (process 0 only), truncated to the resumed step on restart."""

  def __init__(self, path: str, resume_step: int):
    self.path = path
    self.enabled = jax.process_index() == 0
    if self.enabled and os.path.exists(path):
      with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)['step'] <= resume_step]
      with open(path, 'w') as f:
        f.writelines(kept)

  def write(self, record: dict[str, Any]) -> None:
    if self.enabled:
      with open(self.path, 'a') as f:
        f.write(json.dumps(record) + '\n')


def progress_bar(enabled: bool, start: int, total: int):
  import tqdm  # the terminal bar only; metrics.jsonl is the record
  return tqdm.tqdm(initial=start, total=total, disable=not enabled or jax.process_index() != 0,
                   dynamic_ncols=True, desc='train')


def _get(tree: dict, dotted: str):
  for key in dotted.split('.'):
    tree = tree.get(key) if isinstance(tree, dict) else None
  return tree


def with_defaults(saved: dict, defaults: dict) -> dict:
  """`saved` with every key it lacks taken from `defaults`, recursively (configs of older versions)."""
  out = dict(defaults)
  for k, v in saved.items():
    out[k] = with_defaults(v, defaults[k]) if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
  return out


def _flatten(x, prefix: str) -> dict:
  if not isinstance(x, dict):
    return {prefix: x}
  return {k: v for key, value in x.items() for k, v in _flatten(value, f'{prefix}.{key}').items()}


def state_mismatch(saved: dict, current: dict) -> list[str]:
  """'field: saved -> current' for every state-shaping field on which two configs differ."""
  diffs = []
  for field in STATE_SHAPING_FIELDS:
    a, b = _flatten(_get(saved, field), field), _flatten(_get(current, field), field)
    diffs += [f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in sorted(set(a) | set(b))
              if json.dumps(a.get(k)) != json.dumps(b.get(k))]
  return diffs


def write_config_atomically(path: str, text: str) -> None:
  tmp = f'{path}.tmp'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)
