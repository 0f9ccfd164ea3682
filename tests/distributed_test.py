"""Two processes joined by jax.distributed (4 CPU devices each, gloo) train exactly like one with 8.

Each run is a subprocess (tests/distributed_worker.py), so every one gets a fresh JAX with its own
device count; the one-process reference and the resumed two-process pair run side by side.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import portpicker
import pytest
from flax import nnx

from mtpd_jax import checkpoint
from mtpd_jax.harness import training

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'distributed_worker.py')
TIMEOUT_S = 240  # for all three processes together; ~20-30 s on 2 idle cores
TOL = 1e-5


def _start(tmp_path, name: str, *args: str):
  """The worker as a subprocess, its stdout and stderr (gloo is chatty) going to `<name>.log`."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_NUM_CPU_DEVICES', 'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')}
  env['JAX_PLATFORMS'] = 'cpu'
  # Unoptimised CPU code compiles in about half the time; every run, single or paired, gets it.
  env['XLA_FLAGS'] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
  log = tmp_path / f'{name}.log'
  with open(log, 'w') as f:
    proc = subprocess.Popen([sys.executable, WORKER, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
  return name, proc, log


def _wait_all(procs, timeout_s: float = TIMEOUT_S) -> None:
  """Wait for every worker; on the first failure or at the timeout, kill the rest and fail with the logs."""
  deadline = time.monotonic() + timeout_s
  try:
    while not all(p.poll() == 0 for _, p, _ in procs):
      failed = any(p.poll() not in (None, 0) for _, p, _ in procs)
      if failed or time.monotonic() > deadline:
        for _, p, _ in procs:  # every live worker prints its Python stacks into its log first
          if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        _kill(procs)
        logs = '\n'.join(f'--- {name} (exit {p.returncode}) ---\n{log.read_text()[-4000:]}'
                         for name, p, log in procs)
        pytest.fail(f'{"a worker failed" if failed else f"workers still running after {timeout_s} s"}:\n{logs}')
      time.sleep(0.2)
  finally:  # also on KeyboardInterrupt: never leave a worker behind
    _kill(procs)


def _kill(procs) -> None:
  for _, p, _ in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def _assert_same_params(got: dict, want: dict) -> None:
  names = sorted(k for k in want if k.startswith('param'))
  assert names and names == sorted(k for k in got if k.startswith('param'))
  for k in names:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=TOL, err_msg=k)


def _pair(tmp_path, tag: str, workdir, steps: int):
  coordinator = f'127.0.0.1:{portpicker.pick_unused_port()}'
  return [_start(tmp_path, f'{tag}{i}', f'--out={workdir}.npz', f'--workdir={workdir}',
                 f'--steps={steps}', '--local_devices=4', f'--coordinator={coordinator}', '--num_processes=2',
                 f'--process_id={i}') for i in range(2)]


LOAD_STRETCH = 3  # timeouts under load stretch by this much: they guard against hangs, not speed


@contextlib.contextmanager
def cpu_load():
  """One busy process per core, as on a CI machine shared with other jobs, where the processes of
  a pair drift apart (the stop must still be one step on both). An idle machine is the easier case
  of the same test, so only the loaded one runs. The load spans the steps around the stop, not the
  start-up or the rerun that checks it, so the tests beside it in the suite lose little time."""
  hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(os.cpu_count() or 2)]
  try:
    yield
  finally:
    for h in hogs:
      h.kill()
      h.wait()


@pytest.mark.slow
@pytest.mark.reliability
def test_sigterm_to_one_of_two_processes_stops_both_at_one_checkpoint_and_the_rerun_ends_like_one_process(tmp_path):
  """The pair stops at one step on a SIGTERM to one process; resumed, it ends with the losses,
  eval loss and parameters of one process with 8 devices, and its checkpoints restore in one.
  (One test for both: a pair run straight through is the same code without the stop.)"""
  steps, multi, single = 20, tmp_path / 'multi', tmp_path / 'single'
  timeout_s = TIMEOUT_S * LOAD_STRETCH
  procs = _pair(tmp_path, 'first', multi, steps)
  metrics, deadline = multi / 'metrics.jsonl', time.monotonic() + timeout_s

  def wait_for_logged_steps(n: int) -> None:
    while not (metrics.exists() and metrics.read_text().count('train/loss') >= n):
      assert time.monotonic() < deadline and all(p.poll() is None for _, p, _ in procs), 'pair did not start'
      time.sleep(0.1)

  try:
    wait_for_logged_steps(1)  # compiled and training: the load starts here, so it spans the stop only
    with cpu_load():
      wait_for_logged_steps(3)  # SIGTERM to process 1 only, once a few steps are logged
      procs[1][1].send_signal(signal.SIGTERM)
      codes = [p.wait(timeout=timeout_s) for _, p, _ in procs]
  finally:
    _kill(procs)
  assert codes == [128 + signal.SIGTERM] * 2, [log.read_text()[-2000:] for _, _, log in procs]
  stopped = {re.search(r'after step (\d+); checkpoint saved', log.read_text()).group(1) for _, _, log in procs}
  assert len(stopped) == 1, stopped  # both processes stopped after the same step...
  saved = checkpoint.Checkpointer(os.path.join(multi, 'checkpoints'), every_steps=0, max_to_keep=2)
  newest = saved.latest_step()
  saved.close()
  assert newest == int(stopped.pop()) and 3 <= newest < steps  # ...and saved it together
  # The rerun resumes there; beside it, one process with 8 devices runs all the steps straight.
  _wait_all(_pair(tmp_path, 'rerun', multi, steps) + [
      _start(tmp_path, 'single', f'--out={single}.npz', f'--workdir={single}',
             f'--steps={steps}', '--local_devices=8')])
  got, want = dict(np.load(f'{multi}.npz')), dict(np.load(f'{single}.npz'))
  assert (got['process_count'], got['device_count'], got['local_device_count']) == (2, 8, 4)
  assert (want['process_count'], want['device_count'], want['local_device_count']) == (1, 8, 8)
  assert len(got['losses']) == len(want['losses']) == steps  # no step lost or logged twice
  np.testing.assert_allclose(got['losses'], want['losses'], rtol=0, atol=1e-4)
  np.testing.assert_allclose(got['eval_loss'], want['eval_loss'], rtol=0, atol=TOL)
  _assert_same_params(got, want)
  # The pair's checkpoints, written together by both processes, restore in one process.
  ckpt = checkpoint.Checkpointer(os.path.join(multi, 'checkpoints'), every_steps=0, max_to_keep=2)
  assert ckpt.all_steps() == [steps - 2, steps]
  ckpt.close()
  model, _ = training.restore_model(str(multi))
  restored = {'param' + jax.tree_util.keystr(path): np.asarray(x)
              for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
  _assert_same_params(restored, want)
