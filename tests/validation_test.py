"""Validation by meaning and one error path (issue 16): every bad input is refused before any work,
in one line that names the field or file, with exit status 2 and the workdir byte for byte unchanged.

Most cases run in-process through experiment.run_sweep (the path experiments.run takes) and the
shared handler mtpd_jax/harness/cli.py; one subprocess per entry point checks the real exit status.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from flax import traverse_util

from configs import base
from conftest import small_config
from mtpd_jax.harness import cli, experiment, validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.reliability


def test_every_field_of_base_config_has_a_rule():
  fields = set(traverse_util.flatten_dict(base.get_config().to_dict(), sep='.'))
  assert not fields - set(validation.FIELD_RULES), f'fields without a rule in validation.FIELD_RULES: {fields - set(validation.FIELD_RULES)}'
  assert not set(validation.FIELD_RULES) - fields, 'rules for fields that base.py no longer has'


def test_the_defaults_satisfy_every_rule():
  validation.check_fields(base.get_config())
  validation.check_fields(small_config())


def test_a_field_no_rule_knows_is_refused():
  config = small_config()
  config.unlock()
  config.train.stepz = 3
  with pytest.raises(ValueError, match=r'train\.stepz=3 is not a field of configs/base\.py'):
    validation.check_fields(config)


def _snapshot(directory):
  out = {}
  for root, _, names in os.walk(directory):
    for name in names:
      with open(os.path.join(root, name), 'rb') as f:
        out[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  """A workdir that looks like a finished run, and token and prompt files good and bad."""
  d = tmp_path_factory.mktemp('validation')
  workdir = d / 'run'
  (workdir / 'checkpoints' / '8').mkdir(parents=True)
  (workdir / 'checkpoints' / '8' / 'state').write_bytes(b'\x00state')
  (workdir / 'config.json').write_text(small_config().to_json(indent=2))
  (workdir / 'metrics.jsonl').write_text('{"step": 2, "train/loss": 3.5}\n')
  (d / 'results').mkdir()
  (d / 'results' / 'results.md').write_text('| earlier report |\n')
  np.save(d / 'good.npy', np.arange(4000, dtype=np.int32) % 63 + 1)
  np.save(d / 'negative.npy', np.full((4000,), -3, np.int32))
  np.save(d / 'big_ids.npy', np.full((4000,), 64, np.int32))
  np.save(d / 'floats.npy', np.zeros((4000,), np.float32))
  np.save(d / 'objects.npy', np.array([1, 'a'], dtype=object), allow_pickle=True)
  np.save(d / 'short.npy', np.arange(40, dtype=np.int32))
  (d / 'text.npy').write_text('hello world, not an array\n')
  (d / 'truncated.npy').write_bytes((d / 'good.npy').read_bytes()[:1000])
  jsonl = {
      'ids_ok': '{"prompt": [1, 2, 3]}\n',
      'ids_big': '{"prompt": [1, 2, 64]}\n',
      'ids_negative': '{"prompt": [1, -1]}\n',
      'ids_long': json.dumps({'prompt': list(range(1, 40))}) + '\n',
      'text': '{"prompt": "hello"}\n',
      'empty': '',
      'blank_lines': '\n\n',
      'bad_json': '{"prompt": [1, 2]}\n{"prompt": [1, 2\n',
      'no_field': '{"text": [1, 2]}\n',
      'array_record': '[1, 2, 3]\n',
      'number': '{"prompt": 7}\n',
      'empty_text': '{"prompt": ""}\n',
      'bools': '{"prompt": [true, false]}\n',
  }
  for name, text in jsonl.items():
    (d / f'{name}.jsonl').write_text(text)
  (d / 'latin1.jsonl').write_bytes(b'{"prompt": [1]}\n{"prompt": "caf\xe9"}\n')
  return d, str(workdir)


def _tokens(name):
  return {'data.source': 'tokens', 'data.train_path': '{d}/' + name, 'data.eos_id': 0, 'data.eval_fraction': 0.1}


def _jsonl(name, field=''):
  return {'eval.jsonl': (f'mine={{d}}/{name}.jsonl' + (f':{field}' if field else ''),)}


# (class, overrides of small_config(num_mtp_heads=2), text the one line must contain)
CASES = [
    # Silent acceptance: these ran (or trained nothing) and exited 0.
    ('silent', {'seeds': 0}, 'seeds=0 must be an int >= 1'),
    ('silent', {'train.trainable': []}, 'train.trainable=[] must be'),
    ('silent', {'train.trainable': [1, 1]}, 'distinct head indices'),
    ('silent', {'model.num_mtp_heads': 0, 'train.trainable': 'mtp_heads'}, 'no heads to train alone'),
    ('silent', {'distill.beta': float('nan')}, 'distill.beta=nan must be'),
    ('silent', {'distill.beta': float('inf')}, 'distill.beta=inf must be'),
    ('silent', {'distill.beta': (0.5, float('nan'))}, 'distill.beta=(0.5, nan) must be'),
    ('silent', {'distill.tau': float('inf')}, 'distill.tau=inf must be a finite number > 0'),
    ('silent', {'train.lr': float('nan')}, 'train.lr=nan must be a finite number > 0'),
    ('silent', {'train.lr': 0.0}, 'train.lr=0.0 must be'),
    ('silent', {'train.b1': 1.0}, 'train.b1=1.0 must be a finite number in [0, 1)'),
    ('silent', {'train.b2': -0.1}, 'train.b2=-0.1 must be'),
    ('silent', {'train.warmup_frac': 2.0}, 'train.warmup_frac=2.0 must be a finite number in [0, 1]'),
    ('silent', {'train.min_lr_frac': -0.5}, 'train.min_lr_frac=-0.5'),
    ('silent', {'train.weight_decay': -1.0}, 'train.weight_decay=-1.0 must be'),
    ('silent', {'train.clip_norm': 0.0}, 'train.clip_norm=0.0 must be a finite number > 0'),
    ('silent', {'mtp.ce_weight': -0.3}, 'mtp.ce_weight=-0.3 must be'),
    ('silent', {'model.norm_eps': 0.0}, 'model.norm_eps=0.0 must be'),
    ('silent', {'model.rope_base': -1.0}, 'model.rope_base=-1.0 must be'),
    ('silent', {'distill.step_gamma': 0.0}, 'distill.step_gamma=0.0 must be'),
    ('silent', {'data.code_fraction': 1.5}, 'data.code_fraction=1.5 must be a finite number in [0, 1]'),
    ('silent', {'data.eos_id': 64}, 'data.eos_id=64 must be an int in [0, model.vocab_size=64)'),
    ('silent', {'data.eos_id': -1}, 'data.eos_id=-1'),
    ('silent', {'eval.prompt_sets': ('chat', 'poetry')}, "eval.prompt_sets=('chat', 'poetry') must be"),
    ('silent', {'eval.jsonl': ('no_equals_sign',)}, "eval.jsonl=('no_equals_sign',) must be"),
    ('silent', {'model.num_mtp_heads': 0, 'eval.draft_depth': 2}, 'eval.draft_depth=2 drafts with MTP heads'),
    ('silent', {'eval.max_prompt_tokens': 20, 'eval.max_new_tokens': 20}, 'exceeds model.max_seq_len=32'),
    ('silent', {'distill.warmup_steps': -5}, 'distill.warmup_steps=-5'),
    ('silent', {'base.steps': -1}, 'base.steps=-1'),
    ('silent', {'model.moe.aux_loss_weight': -0.01}, 'model.moe.aux_loss_weight=-0.01'),
    ('silent', {'train.init_from': '/no/such/workdir'}, "train.init_from='/no/such/workdir' is neither"),
    ('silent', _tokens('negative.npy'), 'negative.npy holds id -3; token ids must be >= 0'),
    ('silent', {**_tokens('good.npy'), **_jsonl('ids_big')}, 'ids_big.jsonl:1: token id 64 is outside'),
    ('silent', {**_tokens('good.npy'), **_jsonl('ids_negative')}, 'ids_negative.jsonl:1: token id -1'),
    ('silent', {**_tokens('good.npy'), **_jsonl('ids_long')}, 'ids_long.jsonl:1: 39 prompt ids exceed model.max_seq_len=32'),
    ('silent', {**_tokens('good.npy'), **_jsonl('bools')}, 'bools.jsonl:1: field'),
    # Tracebacks: zero or a wrong type where the code divides, iterates or converts.
    ('traceback', {'model.num_heads': 0}, 'model.num_heads=0 must be an int >= 1'),
    ('traceback', {'model.num_kv_heads': 0}, 'model.num_kv_heads=0 must be an int in [1, model.num_heads=4]'),
    ('traceback', {'model.num_kv_heads': 3}, 'model.num_heads=4 is not a multiple of model.num_kv_heads=3'),
    ('traceback', {'model.head_dim': 0}, 'model.head_dim=0 must be'),
    ('traceback', {'model.head_dim': 7}, 'model.head_dim=7 must be even'),
    ('traceback', {'model.dim': 0}, 'model.dim=0'),
    ('traceback', {'model.num_layers': 0}, 'model.num_layers=0'),
    ('traceback', {'model.mlp_dim': 0}, 'model.mlp_dim=0'),
    ('traceback', {'model.vocab_size': 0}, 'model.vocab_size=0'),
    ('traceback', {'train.log_every': 0}, 'train.log_every=0 must be an int >= 1'),
    ('traceback', {'data.synthetic_records': 0}, 'data.synthetic_records=0 must be an int >= 1'),
    ('traceback', {'data.synthetic_records': 4}, 'data.synthetic_records=4 is fewer than data.batch_size=8'),
    ('traceback', {'data.batch_size': 0}, 'data.batch_size=0'),
    ('traceback', {'data.seq_len': 0}, 'data.seq_len=0'),
    ('traceback', {'distill.beta': 'abc'}, "distill.beta='abc' must be None or a finite number"),
    ('traceback', {'train.trainable': 'heads'}, "train.trainable='heads' must be"),
    ('traceback', {'model.moe.num_experts': 2, 'model.moe.top_k': 3}, 'model.moe.top_k=3 must lie in 1..'),
    ('traceback', {'model.moe.group_size': 64}, 'model.moe.group_size=64 must be an int in [0, data.seq_len=16]'),
    ('traceback', {'mesh.shape': (0, 1, 1)}, 'mesh.shape=(0, 1, 1) must be'),
    ('traceback', {'mesh.shape': (-1, -1, 1)}, 'mesh.shape=(-1, -1, 1) must be'),
    ('traceback', {'mesh.axes': ('data', 'data', 'model')}, 'mesh.axes='),
    ('traceback', {'ckpt.max_to_keep': 0}, 'ckpt.max_to_keep=0 must be an int >= 1'),
    ('traceback', {'eval.max_new_tokens': 0}, 'eval.max_new_tokens=0'),
    ('traceback', {'eval.repeats': 0}, 'eval.repeats=0'),
    # Late: found only after training before; now before any work.
    ('late', {'eval.batch_size': 0}, 'eval.batch_size=0 must be an int >= 1'),
    ('late', {'train.eval_batches': 0}, 'train.eval_batches=0 must be an int >= 1'),
    ('late', {'looped.schedule': (1, 2), 'looped.stage_steps': 0}, 'looped.stage_steps=0 must be an int >= 1'),
    ('late', {'data.eval_fraction': 0.0}, 'data.eval_fraction=0.0 must be a finite number in (0, 1)'),
    ('late', {'data.eval_fraction': 1.0}, 'data.eval_fraction=1.0'),
    ('late', {**_tokens('good.npy'), 'data.eval_fraction': 0.01}, "good.npy: its held-out part"),
    ('late', {**_tokens('short.npy')}, 'short.npy: its training part'),
    ('late', {**_tokens('good.npy'), **_jsonl('empty')}, 'empty.jsonl holds no records'),
    ('late', {**_tokens('good.npy'), **_jsonl('blank_lines')}, 'blank_lines.jsonl holds no records'),
    ('late', {**_tokens('good.npy'), **_jsonl('text')}, 'text.jsonl:1: field'),
    ('late', {**_jsonl('text')}, 'only the embedded data source has a tokenizer'),
    ('late', {**_tokens('good.npy'), **_jsonl('ids_ok', 'ids')}, "ids_ok.jsonl:1: no field 'ids'"),
    ('late', {**_tokens('good.npy'), 'eval.jsonl': ('mine={d}/missing.jsonl',)}, 'missing.jsonl does not exist'),
    ('late', {'data.source': 'tokens', 'data.train_path': ''}, "data.source='tokens' needs data.train_path"),
    ('late', {**_tokens('good.npy'), **_jsonl('ids_ok'), 'eval.chat_template': 'on'},
     "eval.chat_template='on' needs a tokenizer with a chat format"),
    ('late', {'train.trunk_cache': True}, 'train.trunk_cache=True needs a frozen trunk'),
    ('late', {'train.trunk_cache': True, 'train.trainable': 'mtp_heads', 'model.moe.num_experts': 4},
     'not supported for MoE models yet'),
    ('late', {'train.trunk_cache_dtype': 'float16'}, "train.trunk_cache_dtype='float16' must be"),
    # Unclear: the message must name the file (and line), and say what is wrong in our terms.
    ('unclear', _tokens('text.npy'), 'text.npy is not a .npy array file'),
    ('unclear', _tokens('truncated.npy'), 'truncated.npy is truncated'),
    ('unclear', _tokens('objects.npy'), 'objects.npy holds Python objects'),
    ('unclear', _tokens('floats.npy'), 'floats.npy: expected a 1-D integer array'),
    ('unclear', _tokens('big_ids.npy'), 'big_ids.npy holds id 64 >= vocab_size 64'),
    ('unclear', _tokens('missing.npy'), 'token file {d}/missing.npy does not exist'),
    ('unclear', {**_tokens('good.npy'), **_jsonl('bad_json')}, 'bad_json.jsonl:2: not valid JSON'),
    ('unclear', {**_tokens('good.npy'), **_jsonl('latin1')}, 'latin1.jsonl:2: not UTF-8 text'),
    ('unclear', {**_tokens('good.npy'), **_jsonl('no_field')}, "no_field.jsonl:1: no field 'prompt'"),
    ('unclear', {**_tokens('good.npy'), **_jsonl('array_record')}, 'array_record.jsonl:1: no field'),
    ('unclear', {**_tokens('good.npy'), **_jsonl('number')}, 'number.jsonl:1: field'),
    ('unclear', {**_tokens('good.npy'), **_jsonl('empty_text')}, "empty_text.jsonl:1: field 'prompt' is empty"),
]


@pytest.mark.parametrize('kind,overrides,message', CASES,
                         ids=[f'{k}-{",".join(f"{n}={v}" for n, v in o.items())}'[:80] for k, o, _ in CASES])
def test_bad_input_is_one_named_line_exit_2_before_any_work(files, capsys, kind, overrides, message):
  d, workdir = files
  config = small_config(num_mtp_heads=2)
  config.eval.update(max_prompt_tokens=8, max_new_tokens=8)  # fits model.max_seq_len=32
  config.update_from_flattened_dict({k: v.format(d=d) if isinstance(v, str) else
                                     tuple(x.format(d=d) for x in v) if isinstance(v, tuple) and v and
                                     isinstance(v[0], str) else v for k, v in overrides.items()})
  before = _snapshot(d)
  with pytest.raises(Exception) as info:  # what experiments.run's main does
    validation.check_fields(config)
    validation.check_decoding_fits(config)
    experiment.run_sweep(config, [{}], workdir, str(d / 'results'), root=str(d), progress=False)
  assert cli.report(info.value, verbose=False) == 2, f'{kind}: {info.value!r} is not an expected error'
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), lines
  assert message.format(d=d) in lines[0], lines[0]
  assert _snapshot(d) == before


# ---------------------------------------------------------------------------------------------
# Config files and the handler itself


@pytest.fixture
def config_files(tmp_path):
  texts = {'syntax.py': 'def get_config(:\n  pass\n',
           'not_configdict.py': 'def get_config():\n  return {"a": 1}\n',
           'no_get_config.py': 'X = 1\n',
           'import_error.py': 'import no_such_module_here\n',
           'raises.py': 'def get_config():\n  return 1 / 0\n'}
  for name, text in texts.items():
    (tmp_path / name).write_text(text)
  (tmp_path / 'latin1.py').write_bytes(b'# caf\xe9\n')
  return tmp_path


@pytest.mark.parametrize('name,arg,message', [
    ('configs/tiny.py', 'quick', "its get_config() takes no argument, so 'tiny:quick'"),
    ('configs/ablation_topn.py', 'fast', "get_config('fast'): unknown config argument 'fast'"),
    ('syntax.py', '', 'syntax.py:1: invalid syntax'),
    ('not_configdict.py', '', 'get_config() returned a dict, not an ml_collections.ConfigDict'),
    ('no_get_config.py', '', 'defines no get_config()'),
    ('import_error.py', '', "failed to import: ModuleNotFoundError: No module named 'no_such_module_here'"),
    ('raises.py', '', 'get_config(): ZeroDivisionError'),
    ('latin1.py', '', 'latin1.py is not UTF-8 text'),
])
def test_a_bad_config_file_is_named_with_the_real_reason(config_files, capsys, name, arg, message):
  path = os.path.join(ROOT, name) if name.startswith('configs/') else str(config_files / name)
  with pytest.raises(cli.InputError) as info:
    cli.check_config_file(path, arg)
  assert cli.report(info.value, verbose=False) == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and path in lines[0] and message in lines[0], lines


@pytest.mark.parametrize('error,status,message', [
    (FloatingPointError('non-finite loss or gradient at step 4; last good checkpoint: None'), 2, 'at step 4'),
    (RuntimeError('no readable checkpoint in w/checkpoints: steps [2] were all damaged'), 2, 'no readable'),
    (KeyError('mine.jsonl:3: no field'), 2, 'error: mine.jsonl:3: no field'),
    (ValueError('first line\nsecond line'), 2, 'error: first line second line'),
    (ZeroDivisionError('division by zero'), 1, 'rerun with --verbose for the traceback'),
    (TypeError('unsupported operand'), 1, 'error: TypeError: unsupported operand'),
])
def test_the_handler_prints_one_line_and_the_right_status(capsys, error, status, message):
  assert cli.report(error, verbose=False) == status
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and message in lines[0], lines


def test_verbose_adds_the_traceback(capsys):
  try:
    raise ZeroDivisionError('division by zero')
  except ZeroDivisionError as e:
    assert cli.report(e, verbose=True) == 1
  err = capsys.readouterr().err
  assert 'Traceback (most recent call last)' in err and err.splitlines()[-1].startswith('error: ')


def test_a_wrapped_config_file_error_shows_the_innermost_reason():
  try:
    try:
      raise ValueError("unknown config argument 'fast'")
    except ValueError as inner:
      raise ValueError('Error whilst parsing config file:\n\nTraceback (most recent call last):\n  ...') from inner
  except ValueError as e:
    assert cli.one_line(e) == "ValueError: unknown config argument 'fast'"


def test_a_preempted_run_exits_128_plus_the_signal(monkeypatch):
  from mtpd_jax import runtime
  def body():
    raise runtime.Preempted(5, signal.SIGTERM)
  monkeypatch.setattr(sys, 'argv', ['x'])
  with pytest.raises(SystemExit) as info:
    cli.run(body)
  assert info.value.code == 128 + signal.SIGTERM


# ---------------------------------------------------------------------------------------------
# experiments.evaluate checks its inputs before restoring anything


@pytest.mark.parametrize('setup,depth,message', [
    ('missing', 0, 'is not a directory'),
    ('empty', 0, 'holds no config.json'),
    ('bad_json', 0, 'config.json'),
    ('no_checkpoints', 0, 'holds no checkpoint to evaluate'),
    ('no_heads', 2, '--draft_depth=2: the model of'),
    ('no_checkpoints', -1, '--draft_depth=-1 must be >= 0'),
])
def test_evaluate_refuses_a_bad_workdir_in_one_line(tmp_path, capsys, setup, depth, message):
  from experiments import evaluate as evaluate_cli
  workdir = tmp_path / 'w'
  if setup != 'missing':
    workdir.mkdir()
  if setup == 'bad_json':
    (workdir / 'config.json').write_text('{"model": ')
  if setup in ('no_checkpoints', 'no_heads'):
    (workdir / 'config.json').write_text(small_config(num_mtp_heads=0 if setup == 'no_heads' else 2).to_json())
  before = _snapshot(tmp_path)
  with pytest.raises(Exception) as info:
    evaluate_cli.check_inputs(str(workdir), depth)
  assert cli.report(info.value, verbose=False) == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and message in lines[0], lines
  assert _snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# One subprocess per entry point: the real exit status and exactly one line on stderr


ENV = {**os.environ, 'JAX_NUM_CPU_DEVICES': '1'}


def _cli(module, *args, timeout=180):
  return subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=timeout)


@pytest.mark.parametrize('module,args,message', [
    ('experiments.run', ['--config=tiny:quick'], "'tiny:quick' is not a variant"),
    ('experiments.evaluate', [], 'Flag --workdir must have a value'),
    ('benchmarks.train_memory', ['--bogus'], "Unknown command line flag 'bogus'"),
    ('benchmarks.hf_parity', ['--ref=/no/such.gguf'], '/no/such.gguf'),
    ('experiments.config_doc', ['--write', '/no/such/README.md'], '/no/such/README.md'),
])
def test_each_entry_point_exits_2_with_one_line(module, args, message):
  proc = _cli(module, *args)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith('error: '), proc.stderr[-2000:]
  assert message in lines[0], lines[0]


@pytest.mark.slow
def test_a_nan_stop_is_one_line_exit_2(tmp_path):
  proc = _cli('experiments.run', '--config=tiny', f'--workdir={tmp_path}/run', '--config.train.lr=1e6',
              '--config.train.steps=30', '--config.eval.enabled=False', timeout=300)
  # The progress bar shares stderr (carriage returns); the error starts a line of its own.
  lines = [line for line in proc.stderr.replace('\r', '\n').splitlines() if line.strip() and 'train:' not in line]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith('error: non-finite loss or gradient at step') and 'Traceback' not in proc.stderr
