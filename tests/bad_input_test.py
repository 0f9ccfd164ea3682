"""Bad input: a one-line error, exit status 2, and the workdir's files left byte for byte as they were."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, 'JAX_NUM_CPU_DEVICES': '2'}
pytestmark = pytest.mark.reliability


def _run(args, timeout=120):
  return subprocess.run([sys.executable, '-m', 'experiments.run', *args], cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=timeout)


def _run_in_process(args, capsys) -> tuple[int, str]:
  """(exit status, stderr) of `python -m experiments.run ARGS`, run in this process: the entry
  point's own code path (absl flags, cli.run's one-line handler) without a Python start per case.
  tests/validation_test.py runs each entry point once as a real subprocess."""
  from absl import flags
  from experiments import run as run_cli
  def reset():  # absl keeps values of an earlier parse, and config_flags defines a flag per override
    flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith('config.')]:
      delattr(flags.FLAGS, name)
  argv = sys.argv
  reset()
  sys.argv = ['experiments.run', *args]
  capsys.readouterr()
  try:
    with pytest.raises(SystemExit) as exit_info:
      run_cli.run()
  finally:
    sys.argv = argv
    reset()
  return exit_info.value.code, capsys.readouterr().err


def _snapshot(directory):
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  """A workdir holding a finished two-step tiny run, and token/prompt files good and bad."""
  d = tmp_path_factory.mktemp('bad_input')
  workdir = str(d / 'run')
  proc = _run(['--config=tiny', f'--workdir={workdir}', '--config.train.steps=2', '--config.ckpt.every_steps=1',
               '--config.eval.enabled=False'], timeout=300)
  assert proc.returncode == 0, proc.stderr
  np.save(d / 'empty.npy', np.zeros((0,), np.int32))
  np.save(d / 'big_ids.npy', np.full((1000,), 300, np.int32))   # tiny's vocabulary is 256
  np.save(d / 'matrix.npy', np.zeros((10, 10), np.int32))
  (d / 'prompts.jsonl').write_text('{"text": "no prompt field"}\n')
  return d, workdir


CASES = [  # (extra arguments, text the one-line message must contain)
    (['--config=no_such_config'], 'config file'),
    (['--config.distill.top_n=0'], 'distill.top_n=0'),
    (['--config.distill.top_n=100000'], 'distill.top_n=100000'),
    (['--config.distill.beta=-1.0'], 'distill.beta=-1.0 must be None or a finite number >= 0'),
    (['--config.distill.beta=(0.5,0.5)'], 'must be one value per head: 4 values'),
    (['--config.model.num_mtp_heads=-1'], 'model.num_mtp_heads=-1'),
    (['--config.distill.kl=sideways'], "distill.kl='sideways' must be one of"),
    (['--config.distill.teacher=oracle'], 'distill.teacher'),
    (['--config.distill.beta_schedule=zigzag'], 'distill.beta_schedule'),
    (['--config.distill.top_n_mode=both'], 'distill.top_n_mode'),
    (['--config.distill.tau=0.0'], 'distill.tau'),
    (['--config.train.on_nan=ignore'], 'train.on_nan'),
    (['--config.train.trainable=[9]'], 'train.trainable=[9] must be'),
    (['--config.train.steps=0'], 'train.steps=0'),
    (['--config.train.loss_chunk_rows=-1'], 'train.loss_chunk_rows=-1'),
    (['--config.model.dtype=float8'], 'model.dtype'),
    (['--config.looped.schedule=(4,2)'], 'looped.schedule'),
    (['--config.mesh.shape=(16,1,1)'], 'mesh.shape'),
    (['--config.mesh.axes=("data","fsdp","tensor")'], 'mesh.axes'),
    (['--config.data.batch_size=7'], 'not divisible'),
    (['--config.data.seq_len=4096'], 'data.seq_len=4096 must be an int in [1, model.max_seq_len=128]'),
    (['--config.eval.draft_depth=-2'], 'eval.draft_depth'),
    (['--config.eval.draft_depth=10', '--config.eval.tree=(2,2,2,2,2,2,2,2,2,2)', '--config.eval.batch_size=64'],
     'paths) holds a'),
    (['--config.data.source=web'], 'data.source'),
    (['--config.data.source=tokens', '--config.data.train_path=/no/such.npy'], 'token file /no/such.npy does not exist'),
    (['--config.data.source=tokens', '--config.data.train_path={d}'], 'is a directory; name the .npy file'),
    (['--config.data.source=tokens', '--config.data.train_path={d}/empty.npy'], 'empty.npy: its training part'),
    (['--config.data.source=tokens', '--config.data.train_path={d}/big_ids.npy'], '>= vocab_size 256'),
    (['--config.data.source=tokens', '--config.data.train_path={d}/matrix.npy'], '1-D integer array'),
    (['--config.eval.jsonl=("chat=/no/such.jsonl",)'], 'eval.jsonl entry'),
    (['--config.model.dim=32', '--config.model.head_dim=8'], 'another model'),
    (['--config.train.resume=never'], 'train.resume=never'),
    (['--config.no_such_field=1'], 'no_such_field'),
    (['--config.mtp.num_headz=2'], "--config.mtp.num_headz: the config has no field 'num_headz'"),
    (['--config.mtp.num_heads=2'], '--config.mtp.num_heads is now --config.model.num_mtp_heads'),
    (['--config.train.steps=many'], 'train.steps'),
    (['--sweep_index=3'], 'sweep_index=3 is not a point of tiny'),
    (['--sweep_index=0,-1'], 'sweep_index=-1'),
    (['--sweep_index='], 'names no point'),
]


@pytest.mark.parametrize('args,message', CASES, ids=[' '.join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_the_workdir_unchanged(files, args, message, capsys):
  d, workdir = files
  before = _snapshot(workdir)
  config = [a for a in args if a.startswith('--config=')] or ['--config=tiny']
  rest = [a.format(d=d) for a in args if not a.startswith('--config=')]
  code, stderr = _run_in_process([*config, f'--workdir={workdir}', *rest], capsys)
  assert code == 2, stderr[-2000:]
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], stderr[-2000:]
  assert _snapshot(workdir) == before


def test_an_unwritable_workdir_is_refused_in_one_line(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  proc = _run(['--config=tiny', f'--workdir={blocker}/run'])
  assert proc.returncode == 2 and proc.stderr.count('\n') == 1 and 'error: ' in proc.stderr, proc.stderr
  assert blocker.read_text() == 'not a directory'
