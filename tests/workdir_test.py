"""Workdirs (issue 16): one process per workdir, variants and reports in places of their own, safe resumes."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from configs import base
from conftest import small_config
from mtpd_jax import workdir_lock
from mtpd_jax.harness import cli, experiment, training, validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, 'JAX_NUM_CPU_DEVICES': '1', 'PYTHONPATH': ROOT}
pytestmark = pytest.mark.reliability


def snapshot(d) -> dict[str, bytes]:
  """Every file under `d`, by relative path, with its bytes."""
  out = {}
  for root, _, files in os.walk(d):
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, d)] = f.read()
  return out


def _holder(workdir):
  """A second process that holds `workdir`'s lock until killed; returns it once it holds it."""
  code = ('import sys, time; from mtpd_jax import workdir_lock\n'
          'with workdir_lock.hold(sys.argv[1], enabled=True):\n'
          '  print("held", flush=True); time.sleep(600)\n')
  proc = subprocess.Popen([sys.executable, '-c', code, str(workdir)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                          text=True)
  assert proc.stdout.readline().strip() == 'held'
  return proc


# ---------------------------------------------------------------------------------------------
# The lock


def test_a_workdir_held_by_another_process_is_refused_naming_its_pid(tmp_path):
  proc = _holder(tmp_path)
  try:
    with pytest.raises(workdir_lock.WorkdirLocked, match=rf'in use by pid {proc.pid} on '):
      with workdir_lock.hold(str(tmp_path), enabled=True):
        pass
  finally:
    proc.kill()
    proc.wait()
  # Killed (SIGKILL): the kernel released its flock; the file it left is a stale lock, taken over.
  with workdir_lock.hold(str(tmp_path), enabled=True):
    assert (tmp_path / '.lock').read_text().split()[0] == str(os.getpid())


def test_a_stale_lock_is_taken_over_with_one_warning_and_a_release_leaves_nothing(tmp_path, caplog):
  (tmp_path / 'keep.txt').write_text('x')
  before = snapshot(tmp_path)
  (tmp_path / '.lock').write_text('999999999 gone-host\n')
  with caplog.at_level(logging.WARNING), workdir_lock.hold(str(tmp_path), enabled=True):
    assert (tmp_path / '.lock').read_text().split()[0] == str(os.getpid())
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and 'stale lock of pid 999999999 on gone-host' in warnings[0], warnings
  assert snapshot(tmp_path) == before  # the lock file is gone again


def test_the_lock_is_reentrant_in_a_process_and_released_on_an_exception(tmp_path):
  with pytest.raises(KeyError):
    with workdir_lock.hold(str(tmp_path), enabled=True):
      with workdir_lock.hold(str(tmp_path), enabled=True):  # a sweep point, then train_and_evaluate
        pass
      assert (tmp_path / '.lock').exists()  # the inner release keeps the outer hold
      raise KeyError('boom')
  assert not (tmp_path / '.lock').exists()
  proc = _holder(tmp_path)  # another process can take it now
  proc.kill()
  proc.wait()


def test_only_process_0_of_a_multi_process_run_locks(tmp_path):
  with workdir_lock.hold(str(tmp_path), enabled=False):
    assert not (tmp_path / '.lock').exists()


@pytest.mark.slow
def test_evaluate_of_a_workdir_in_use_refuses_in_one_line_and_changes_nothing(tmp_path):
  training.train_and_evaluate(small_config(steps=2), str(tmp_path), progress=False)
  before = snapshot(tmp_path)
  proc = _holder(tmp_path)
  try:
    out = subprocess.run([sys.executable, '-m', 'experiments.evaluate', f'--workdir={tmp_path}'], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
  finally:
    proc.kill()
    proc.wait()
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2, out.stderr[-2000:]
  assert len(lines) == 1 and f'in use by pid {proc.pid}' in lines[0], out.stderr
  after = snapshot(tmp_path)
  after.pop('.lock', None)  # left by the killed holder: a stale lock, not the workdir's data
  assert after == before


@pytest.mark.slow
def test_a_second_run_on_a_workdir_being_trained_refuses_naming_the_first_runs_pid(tmp_path):
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'experiments.run', '--config=tiny', f'--workdir={workdir}', '--config.train.steps=5000',
         '--config.ckpt.every_steps=100000', '--config.eval.enabled=False', '--config.train.log_every=1']
  first = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 240
    while not (workdir / 'metrics.jsonl').exists() or not (workdir / 'metrics.jsonl').read_text().count('\n'):
      assert first.poll() is None and time.monotonic() < deadline, 'the first run did not start'
      time.sleep(0.2)
    second = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2, second.stderr[-2000:]
    assert len(lines) == 1 and f'in use by pid {first.pid}' in lines[0], second.stderr
    assert first.poll() is None  # the first run goes on
  finally:
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
  assert first.returncode == 128 + signal.SIGTERM
  assert not (workdir / '.lock').exists()  # released on the way out


# ---------------------------------------------------------------------------------------------
# Places: variants and reports


@pytest.mark.parametrize('arg, workdir, results_dir, want', [
    ('', None, None, ('runs/ablation_topn', 'results/ablation_topn')),
    ('quick', None, None, ('runs/ablation_topn-quick', 'results/ablation_topn-quick')),
    ('a/b c', None, None, ('runs/ablation_topn-a_b_c', 'results/ablation_topn-a_b_c')),
    ('quick', 'mine', None, ('mine', 'mine/report')),
    ('', 'mine', 'elsewhere', ('mine', 'elsewhere')),
])
def test_every_variant_and_workdir_gets_its_own_places(arg, workdir, results_dir, want):
  assert experiment.run_places('ablation_topn', arg, workdir, results_dir) == want


CONFIG = textwrap.dedent('''
    """A tiny config whose :quick variant is another model, as ablation_topn:quick is."""
    from configs import tiny

    def get_config(arg=None):
      c = tiny.get_config()
      c.train.steps, c.ckpt.every_steps, c.train.log_every = 3, 3, 1
      c.eval.enabled = False
      if arg == 'quick':
        c.model.dim, c.train.steps = 32, 2
      return c
''')


@pytest.mark.slow
def test_the_quick_and_the_full_variant_follow_each_other_in_either_order(tmp_path):
  (tmp_path / 'mini.py').write_text(CONFIG)

  def run(arg, *flags):
    out = subprocess.run([sys.executable, '-m', 'experiments.run', f'--config={tmp_path / "mini.py"}{arg}', *flags],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
  run(':quick')  # the README's smoke run, then the main job
  run('')
  full_report = snapshot(tmp_path / 'results' / 'mini')
  assert 'results.md' in full_report and snapshot(tmp_path / 'results' / 'mini-quick')
  assert json.loads((tmp_path / 'runs' / 'mini' / 'config.json').read_text())['model']['dim'] == 64
  assert json.loads((tmp_path / 'runs' / 'mini-quick' / 'config.json').read_text())['model']['dim'] == 32
  quick_report = tmp_path / 'results' / 'mini-quick' / 'results.md'
  os.utime(quick_report, (0, 0))
  assert 'finished earlier' in run(':quick')  # again: resumes its own run, rewrites its own report...
  assert os.path.getmtime(quick_report) > 0
  assert snapshot(tmp_path / 'results' / 'mini') == full_report  # ...and leaves the full run's alone
  run(':quick', '--workdir=elsewhere')  # another workdir: its report lives with it (compiled already)
  assert (tmp_path / 'elsewhere' / 'report' / 'results.md').exists()
  assert snapshot(tmp_path / 'results' / 'mini') == full_report


# ---------------------------------------------------------------------------------------------
# Resume


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A workdir of small_config(steps=4): checkpoints 4, metrics, config.json."""
  d = tmp_path_factory.mktemp('trained')
  training.train_and_evaluate(small_config(steps=4), str(d), progress=False)
  return d


@pytest.fixture
def workdir(trained, tmp_path):
  d = tmp_path / 'run'
  shutil.copytree(trained, d)
  return d


@pytest.mark.parametrize('field, value, shown', [
    ('distill.kl', 'reverse', "distill.kl: 'forward' -> 'reverse'"),
    ('distill.top_n', None, 'distill.top_n: 8 -> None'),
    ('distill.beta', 0.25, 'distill.beta: None -> 0.25'),
    ('mtp.ce_weight', 0.5, 'mtp.ce_weight: 0.3 -> 0.5'),
    ('train.lr', 1e-3, 'train.lr: 0.003 -> 0.001'),
    ('data.seed', 7, 'data.seed: 0 -> 7'),
    ('data.batch_size', 4, 'data.batch_size: 8 -> 4'),
    ('seed', 3, 'seed: 0 -> 3'),
])
def test_resuming_with_another_loss_or_data_order_is_refused_and_changes_nothing(workdir, field, value, shown):
  config = small_config(steps=8)  # a longer run: the 4-step one is unfinished for it
  config.update_from_flattened_dict({field: value})
  before = snapshot(workdir)
  with pytest.raises(ValueError, match='holds a run with other settings') as e:
    training.train_and_evaluate(config, str(workdir), progress=False)
  assert shown in str(e.value) and '\n' not in str(e.value)
  assert snapshot(workdir) == before


@pytest.mark.slow
def test_resuming_with_other_logging_eval_checkpoint_settings_and_more_steps_is_allowed(workdir):
  config = small_config(steps=6)
  config.train.log_every, config.train.eval_batches, config.ckpt.every_steps = 1, 2, 3
  config.eval.max_prompts, config.eval.enabled = 2, False
  state, _ = training.train_and_evaluate(config, str(workdir), progress=False)
  assert int(state.step) == 6
  steps = [json.loads(l)['step'] for l in open(workdir / 'metrics.jsonl') if 'train/loss' in l]
  assert steps == [2, 4, 5, 6]


@pytest.mark.parametrize('max_to_keep', [0, -1])
def test_max_to_keep_below_one_is_refused_before_anything_is_touched(workdir, max_to_keep):
  config = small_config(steps=8)
  config.ckpt.max_to_keep = max_to_keep
  before = snapshot(workdir)
  with pytest.raises(ValueError, match=rf'ckpt.max_to_keep={max_to_keep} must be an int >= 1'):
    training.train_and_evaluate(config, str(workdir), progress=False)
  assert snapshot(workdir) == before
  with pytest.raises(ValueError, match='ckpt.max_to_keep'):  # the sweep checks it before its first point
    experiment.run_sweep(config, [{}], str(workdir), str(workdir / 'report'))
  assert snapshot(workdir) == before


def test_a_torn_last_metrics_line_is_dropped_with_one_warning(workdir, caplog):
  path = workdir / 'metrics.jsonl'
  whole = path.read_bytes()
  path.write_bytes(whole + b'{"step": 5, "train/lo')  # a crash mid-write, after checkpoint 4
  with caplog.at_level(logging.WARNING):
    training.train_and_evaluate(small_config(steps=6), str(workdir), progress=False)
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and 'metrics.jsonl, line' in warnings[0] and 'cut short' in warnings[0], warnings
  text = path.read_bytes()
  assert text.startswith(whole) and b'train/lo"' not in text  # earlier rows kept byte for byte
  assert [json.loads(l)['step'] for l in text.splitlines() if b'train/loss' in l] == [2, 4, 6]


def test_an_unreadable_metrics_line_before_the_last_is_refused_naming_the_line(workdir):
  path = workdir / 'metrics.jsonl'
  lines = path.read_bytes().splitlines(keepends=True)
  path.write_bytes(lines[0] + b'garbage\n' + b''.join(lines[1:]))
  before = snapshot(workdir)
  with pytest.raises(ValueError, match=r'metrics.jsonl, line 2: not a metrics record'):
    training.train_and_evaluate(small_config(steps=6), str(workdir), progress=False)
  assert snapshot(workdir) == before


def test_checkpoints_without_config_json_are_refused_not_declared_damaged(workdir):
  os.remove(workdir / 'config.json')
  before = snapshot(workdir)
  other = small_config(steps=8)
  other.model.dim = 48  # another model: its restore would fail, which used to move them aside
  with pytest.raises(ValueError, match='holds checkpoints but no config.json') as e:
    training.train_and_evaluate(other, str(workdir), progress=False)
  assert '\n' not in str(e.value)
  assert snapshot(workdir) == before
  assert not os.path.exists(f'{workdir}/checkpoints.unreadable')


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_warning_line_not_a_traceback_per_array(tmp_path, capfd, caplog):
  workdir = tmp_path / 'run'
  config = small_config(steps=8)  # checkpoints 4 and 8
  training.train_and_evaluate(config, str(workdir), progress=False)
  data = workdir / 'checkpoints' / '8' / 'state' / 'd'
  for name in os.listdir(data):  # every data file of the newest checkpoint is lost
    os.remove(data / name)
  capfd.readouterr()
  config.train.steps = 10
  with caplog.at_level(logging.WARNING):
    state, _ = training.train_and_evaluate(config, str(workdir), progress=False)
  assert int(state.step) == 10
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and 'checkpoint 8 is unreadable' in warnings[0], warnings
  assert '\n' not in warnings[0]
  out, err = capfd.readouterr()
  assert 'Traceback' not in out + err and 'Event loop is closed' not in out + err, err[-3000:]


def test_evaluating_a_damaged_checkpoint_is_one_line_exit_2_and_leaves_it_in_place(tmp_path, capsys):
  workdir = tmp_path / 'run'
  training.train_and_evaluate(small_config(steps=4), str(workdir), progress=False)
  data = workdir / 'checkpoints' / '4' / 'state' / 'd'
  for name in os.listdir(data):
    os.remove(data / name)
  with pytest.raises(ValueError) as info:
    training.restore_model(str(workdir))
  assert cli.report(info.value, verbose=False) == 2
  (line,) = capsys.readouterr().err.splitlines()
  assert line.startswith('error: checkpoint 4 in ') and 'is unreadable' in line and 'resumes from' in line
  assert os.path.isdir(workdir / 'checkpoints' / '4') and not os.path.exists(f'{workdir}/checkpoints.unreadable')


def test_a_finished_point_of_a_version_that_lacked_a_field_is_still_this_configs(tmp_path):
  """A field added since a point finished (at its default) does not make a rerun refuse the point;
  a setting the point really ran with otherwise (here, fewer prompts) does."""
  config = small_config(num_mtp_heads=1)
  run_dir = str(tmp_path / 'point')
  os.makedirs(run_dir)
  saved = json.loads(experiment.with_base(config, str(tmp_path)).to_json())
  del saved['distill']['divergence']  # written by a version without the field
  with open(os.path.join(run_dir, 'config.json'), 'w') as f:
    json.dump(saved, f)
  stale, defaults = {'config': 'digest of the older version'}, base.get_config()
  finished = lambda c, d=run_dir, defaults=defaults: experiment._finished_with(stale, c, d, str(tmp_path), defaults)
  assert finished(config)
  assert not finished(config, defaults=None)  # without defaults, only the digest counts
  assert experiment._finished_with({'config': experiment._digest(config.to_json())}, config, 'no such dir', '', None)
  # The older version distilled with the KL (the field's default), so a TV run is not that point.
  for field, value in (('eval.max_prompts', config.eval.max_prompts + 1), ('distill.divergence', 'tv')):
    other = small_config(num_mtp_heads=1)
    other.update_from_flattened_dict({field: value})
    assert not finished(other), field
  assert not finished(config, str(tmp_path / 'no config.json'))


def test_a_config_json_that_names_k_mtp_num_heads_reads_as_model_num_mtp_heads(tmp_path):
  """K was `mtp.num_heads` until it took the core's name (validation.RENAMED): a workdir written
  then reads under the new name, and its finished sweep point is still this config's."""
  config = small_config(num_mtp_heads=3)
  run_dir = str(tmp_path / 'point')
  os.makedirs(run_dir)
  saved = json.loads(experiment.with_base(config, str(tmp_path)).to_json())
  saved['mtp']['num_heads'] = saved['model'].pop('num_mtp_heads')
  with open(os.path.join(run_dir, 'config.json'), 'w') as f:
    json.dump(saved, f)
  read = training.saved_config(run_dir)
  assert read.model.num_mtp_heads == 3 and 'num_heads' not in read.mtp
  stale, defaults = {'config': 'digest of the older version'}, base.get_config()
  assert experiment._finished_with(stale, config, run_dir, str(tmp_path), defaults)
  assert not experiment._finished_with(stale, small_config(num_mtp_heads=2), run_dir, str(tmp_path), defaults)
  # A config or a sweep point that still sets the old name is refused with the new one.
  old = small_config(num_mtp_heads=3)
  with old.unlocked():
    old.mtp.num_heads = 3
  with pytest.raises(ValueError, match='mtp.num_heads is now model.num_mtp_heads'):
    validation.check_fields(old)
  with pytest.raises(ValueError, match="sweep point 'K=2' sets mtp.num_heads, which is now model.num_mtp_heads"):
    experiment.sweep_points([{'label': 'K=2', 'mtp.num_heads': 2}])
