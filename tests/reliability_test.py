"""Reliability: preemption signals, damaged checkpoints, incompatible workdirs, non-finite steps."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import small_config
from mtpd_jax import checkpoint, sharding
from mtpd_jax.harness import training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.reliability


def _steps_logged(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)['step'] for line in f if 'train/loss' in line]


def _ckpt_steps(workdir):
  d = os.path.join(workdir, 'checkpoints')
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


@pytest.mark.slow
def test_sigterm_checkpoints_after_the_current_step_and_a_rerun_resumes(tmp_path):
  workdir = str(tmp_path / 'run')
  cmd = [sys.executable, '-m', 'experiments.run', '--config=tiny', f'--workdir={workdir}',
         '--config.train.steps=2000', '--config.ckpt.every_steps=100000', '--config.eval.enabled=False',
         '--config.train.log_every=1']
  env = {**os.environ, 'JAX_NUM_CPU_DEVICES': '1'}
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 180
  while len(_steps_logged(workdir)) < 5 and time.monotonic() < deadline and proc.poll() is None:
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)  # generous: it guards against hangs on loaded machines
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert 'rerun the same command to resume' in err
  saved = _ckpt_steps(workdir)
  assert len(saved) == 1 and 5 <= saved[0] < 2000
  # The rerun resumes from that checkpoint; metrics.jsonl continues without gaps or repeats.
  subprocess.run(cmd[:-4] + ['--config.train.steps=' + str(saved[0] + 3), '--config.eval.enabled=False',
                             '--config.train.log_every=1', '--config.ckpt.every_steps=100000'],
                 cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
  assert _steps_logged(workdir) == list(range(1, saved[0] + 4))


def _train(config, workdir):
  return training.train_and_evaluate(config, str(workdir), progress=False)


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
  config = small_config(steps=8)   # checkpoints at 4 and 8
  _train(config, tmp_path)
  # Truncate every file of the newest checkpoint's state.
  for root, _, files in os.walk(tmp_path / 'checkpoints' / '8' / 'state'):
    for name in files:
      with open(os.path.join(root, name), 'r+b') as f:
        f.truncate(max(os.path.getsize(os.path.join(root, name)) // 3, 0))
  config.train.steps = 10
  with caplog.at_level('WARNING'):
    state, _ = _train(config, tmp_path)
  assert int(state.step) == 10
  assert any('checkpoint 8 is unreadable' in r.getMessage() and 'falling back to checkpoint 4' in r.getMessage()
             for r in caplog.records)
  # The damaged checkpoint was moved aside, not deleted.
  assert os.listdir(str(tmp_path / 'checkpoints') + '.unreadable')
  # Steps 5..10 were trained again from checkpoint 4.
  steps = [json.loads(l)['step'] for l in open(tmp_path / 'metrics.jsonl') if 'train/loss' in l]
  assert steps == [2, 4, 6, 8, 10]


@pytest.mark.slow
def test_a_workdir_of_another_model_is_refused_and_resume_never_refuses_reuse(tmp_path):
  config = small_config(steps=4)
  _train(config, tmp_path)
  before = _ckpt_steps(str(tmp_path))
  other = small_config(steps=8)
  other.model.dim = 48
  other.model.num_mtp_heads = 3
  with pytest.raises(ValueError, match=r'another model \(model.dim: 32 -> 48; model.num_mtp_heads: 2 -> 3\)'):
    _train(other, tmp_path)
  again = small_config(steps=8)
  again.train.resume = 'never'
  with pytest.raises(ValueError, match='train.resume=never'):
    _train(again, tmp_path)
  assert _ckpt_steps(str(tmp_path)) == before   # nothing on disk was touched


@pytest.mark.slow
def test_a_workdir_saved_before_newer_config_fields_existed_still_resumes(tmp_path):
  config = small_config(steps=4)
  _train(config, tmp_path)
  path = tmp_path / 'config.json'
  saved = json.loads(path.read_text())
  del saved['model']['moe'], saved['data']['tokenizer']  # fields added by later versions
  path.write_text(json.dumps(saved))
  state, _ = _train(small_config(steps=8), tmp_path)  # their defaults match: the same model, resumed
  assert int(state.step) == 8 and _ckpt_steps(str(tmp_path))[-1] == 8
  moe_run = small_config(steps=12)
  moe_run.model.moe.num_experts = 4
  with pytest.raises(ValueError, match=r'another model \(model.moe.num_experts: 0 -> 4\)'):
    _train(moe_run, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize('on_nan', ['stop', 'skip'])
def test_a_non_finite_step_stops_with_its_step_or_is_skipped(tmp_path, on_nan):
  config = small_config(steps=6)
  config.train.lr = 1e30   # the first real update overflows the parameters
  config.train.warmup_frac = 0.0
  config.train.on_nan = on_nan
  if on_nan == 'stop':
    with pytest.raises(FloatingPointError, match=r'non-finite loss or gradient at step \d; last good checkpoint'):
      _train(config, tmp_path)
  else:
    state, _ = _train(config, tmp_path)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
    assert any(r.get('train/skipped_nonfinite') for r in rows)


@pytest.mark.slow
def test_sigkill_at_several_steps_then_rerun_ends_bitwise_equal(tmp_path):
  """Kill -9 mid-run twice (the second time in a resumed run); each rerun resumes; the end state and
  every step's loss match."""
  env = {**os.environ, 'JAX_NUM_CPU_DEVICES': '1'}

  def cmd(workdir):
    return [sys.executable, '-m', 'experiments.run', '--config=tiny', f'--workdir={workdir}',
            '--config.train.steps=30', '--config.ckpt.every_steps=7', '--config.ckpt.max_to_keep=2',
            '--config.eval.enabled=False', '--config.train.log_every=1']
  reference = str(tmp_path / 'reference')
  subprocess.run(cmd(reference), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
  killed = str(tmp_path / 'killed')
  for kill_after in (10, 20):   # steps logged before the kill; checkpoints land every 7 steps
    proc = subprocess.Popen(cmd(killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while (not _steps_logged(killed) or _steps_logged(killed)[-1] < kill_after) and time.monotonic() < deadline:
      assert proc.poll() is None, 'the run ended before it could be killed'
      time.sleep(0.05)
    proc.kill()
    proc.wait()
  subprocess.run(cmd(killed), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)

  def losses(workdir):
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      return [(r['step'], r['train/loss']) for r in map(json.loads, f) if 'train/loss' in r]
  assert losses(killed) == losses(reference)   # the same batch at every step, none skipped or repeated
  a, b = _final_state(reference), _final_state(killed)
  assert int(a.step) == int(b.step) == 30
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params, b.opt_state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _final_state(workdir):
  """The newest checkpoint's whole train state: parameters and optimizer moments."""
  _, config = training.restore_model(workdir)
  mesh = sharding.make_mesh((1,), ('data',))
  abstract, _ = training.abstract_state(config, mesh)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), every_steps=0, max_to_keep=2)
  state = ckpt.restore(ckpt.latest_step(), abstract)
  ckpt.close()
  return state


@pytest.fixture
def small_disk(tmp_path):
  """A 1 MiB tmpfs (needs mount rights, as root in a container has), unmounted afterwards."""
  mnt = tmp_path / 'disk'
  mnt.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mnt)], capture_output=True).returncode:
    pytest.skip('cannot mount a tmpfs here')
  yield mnt
  subprocess.run(['umount', str(mnt)], check=False)


def test_a_disk_too_small_for_the_checkpoints_is_refused_before_any_work(small_disk):
  (small_disk / 'notes.txt').write_text('keep me')
  proc = subprocess.run([sys.executable, '-m', 'experiments.run', '--config=tiny', f'--workdir={small_disk}/run'],
                        cwd=ROOT, env={**os.environ, 'JAX_NUM_CPU_DEVICES': '1'}, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and 'MiB free, but the checkpoints of this run need about' in lines[0], proc.stderr
  assert (small_disk / 'notes.txt').read_text() == 'keep me'
  assert not os.path.exists(small_disk / 'run' / 'config.json')


def test_a_disk_filling_up_mid_save_keeps_the_previous_checkpoint_and_a_rerun_resumes(tmp_path, monkeypatch):
  config = small_config(steps=8)  # checkpoints every 4 steps
  workdir = str(tmp_path / 'run')
  real_save = checkpoint.ocp.CheckpointManager.save

  def save_until_full(self, step, *args, **kwargs):
    if step > 4:  # what tensorstore raises around the OS error
      raise ValueError('write failed') from OSError(28, 'No space left on device')
    return real_save(self, step, *args, **kwargs)
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, 'save', save_until_full)
  with pytest.raises(OSError, match=r'disk full while writing checkpoint 8 .* newest complete checkpoint \(4\)'):
    training.train_and_evaluate(config, workdir, progress=False)
  assert _ckpt_steps(workdir) == [4]
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, 'save', real_save)
  state, _ = training.train_and_evaluate(config, workdir, progress=False)
  assert int(state.step) == 8 and _steps_logged(workdir)[-1] == 8


def test_free_space_need_counts_one_checkpoint_in_flight_beside_the_kept_ones(tmp_path, monkeypatch):
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'c'), every_steps=1, max_to_keep=2)
  abstract = {'w': jax.ShapeDtypeStruct((1024, 256), np.float32)}  # 1 MiB
  free = {'bytes': 3 * 2**20}
  monkeypatch.setattr(checkpoint.shutil, 'disk_usage', lambda _: type('U', (), {'free': free['bytes']}))
  ckpt.check_free_space(abstract)  # 3 MiB for 2 kept + 1 in flight
  free['bytes'] -= 1
  with pytest.raises(OSError, match='need about 3.0 MiB'):
    ckpt.check_free_space(abstract)
