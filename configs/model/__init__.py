"""Model presets: `configs/model/NAME.py` fixes an architecture that any experiment config can take.

A preset's `get_model()` returns the `config.model` fields it sets, as flattened keys ('dim',
'moe.top_k', ...): width, depth, heads, the feed-forward (dense or experts) and, for the
paper-scale presets, the vocabulary. `apply` first resets `model.moe` to base.py's (dense), so a
dense preset is dense whatever came before; fields a preset leaves out (vocabulary, sequence
length, dtype, remat) keep the experiment's values. `experiments/run.py --model=NAME` applies one.
"""

import importlib
import os

import ml_collections

from configs import base

PRESET_DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
  """Every preset: the .py files of configs/model/ (without a leading underscore)."""
  return sorted(f[:-3] for f in os.listdir(PRESET_DIR) if f.endswith('.py') and not f.startswith('_'))


def get_model(name: str) -> dict:
  """The preset's flattened `config.model` overrides; ValueError naming the choices for a bad name."""
  if name not in names():
    raise ValueError(f'unknown model preset {name!r}; expected one of {names()} (configs/model/NAME.py)')
  return importlib.import_module(f'configs.model.{name}').get_model()


def apply(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """`config` (changed in place, and returned) with the architecture of preset `name`."""
  preset = get_model(name)
  config.model.moe.update(base.get_config().model.moe)
  config.model.update_from_flattened_dict(preset)  # a key config.model lacks raises KeyError
  return config
