"""Regenerated training text: the model's own greedy answers, cached by model, corpus and settings;
a killed build is never read as complete and resumes; a damaged part is named in one line."""

import os

import numpy as np
import pytest

from conftest import small_config
from mtpd_jax import decode
from mtpd_jax.harness import corpus, prompts, recipe, regenerate, training

pytestmark = pytest.mark.reliability


@pytest.fixture(scope='module')
def answering(tmp_path_factory):
  """A tiny model trained for 4 steps on a small embedded corpus (BPE of 512 tokens): the one that answers."""
  tmp = tmp_path_factory.mktemp('answering')
  config = small_config(num_mtp_heads=0, steps=4)
  config.model.vocab_size = 512
  config.data.update(source='embedded', embedded_chars=300_000, cache_dir=str(tmp / 'cache'))
  config.eval.enabled = False
  training.train_and_evaluate(config, str(tmp / 'model'), progress=False)
  return config, str(tmp / 'model')


def _config(answering, **fields):
  base, workdir = answering
  config = small_config(num_mtp_heads=2)
  config.model.vocab_size = 512
  config.data.update(source='embedded', embedded_chars=300_000, cache_dir=base.data.cache_dir, regenerate=True,
                     regenerate_new_tokens=6, regenerate_prompt_tokens=24, regenerate_batch_size=4,
                     regenerate_prompts=10)
  config.train.init_from = workdir
  config.update_from_flattened_dict(fields)
  return config


def _user_prompts(config):
  tok = recipe.embedded_data(config).tokenizer()
  texts = corpus.training_user_turns(config.data.embedded_chars, config.data.code_fraction)[:10]
  return tok, prompts.encode_prompts(texts, tokenizer=tok, max_prompt_tokens=24, chat_template=True)


def test_the_training_text_is_the_models_own_greedy_answers(answering):
  config = _config(answering)
  path = regenerate.build(config, lambda: training.answering_model(config), progress=False)
  tok, user = _user_prompts(config)
  answers = decode.generate(training.answering_model(config), user, max_new_tokens=6,
                            stop_tokens=tok.stop_ids).tokens
  stream = np.load(path)
  docs = np.split(stream, np.flatnonzero(stream == tok.eos_id) + 1)[:-1]
  eos = lambda a: [] if len(a) and a[-1] == tok.eos_id else [tok.eos_id]  # the answer's own EOS ends it
  want = sorted(tuple(np.concatenate([p, a, eos(a)]).tolist()) for p, a in zip(user, answers))
  assert sorted(tuple(d.tolist()) for d in docs) == want  # every prompt once, with its own answer
  source = recipe.make_source(config, 'train')
  assert len(source) == (len(stream) - 1) // config.data.seq_len  # all of it is training text
  assert len(recipe.make_source(config, 'eval')) > 0  # held-out text stays the corpus's
  sampled = _config(answering, **{'data.regenerate_temperature': 1.0})
  assert regenerate.directory(sampled) != regenerate.directory(config)


class _Killed(Exception):
  pass


def test_a_killed_regeneration_is_never_read_as_complete_and_resumes(answering, monkeypatch, tmp_path):
  config = _config(answering, **{'data.cache_dir': str(tmp_path / 'cache')})
  calls, generate = [], decode.generate_split

  def killed_on_the_second_batch(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise _Killed
    return generate(*args, **kwargs)
  monkeypatch.setattr(decode, 'generate_split', killed_on_the_second_batch)
  with pytest.raises(_Killed):
    regenerate.build(config, lambda: training.answering_model(config), progress=False)
  with pytest.raises(FileNotFoundError, match='is not built yet'):
    recipe.make_source(config, 'train')
  assert sorted(n for n in os.listdir(regenerate.directory(config)) if n.startswith('part-')) == ['part-00000.npy']
  path = regenerate.build(config, lambda: training.answering_model(config), progress=False)
  assert len(calls) == 2 + 2  # the rerun decoded the two batches still missing, not the first again
  whole = regenerate.build(_config(answering), lambda: training.answering_model(config), progress=False)
  np.testing.assert_array_equal(np.load(path), np.load(whole))


def test_a_damaged_part_is_named_in_one_line(answering, tmp_path):
  config = _config(answering, **{'data.cache_dir': str(tmp_path / 'cache')})
  regenerate.build(config, lambda: training.answering_model(config), progress=False)
  directory = regenerate.directory(config)
  os.remove(os.path.join(directory, 'train_tokens.npy'))
  with open(os.path.join(directory, 'part-00001.npy'), 'r+b') as f:
    f.truncate(20)
  with pytest.raises(ValueError, match=r'regenerated text file .*part-00001.npy is damaged .*delete it'):
    regenerate.build(config, lambda: training.answering_model(config), progress=False)
