"""Trained looped extension (the paper's Sec. 4, Fig. 2, Table 8): grow the number of MTP heads in stages.

Stage 0 trains main model and the first heads as usual. Each later stage freezes the main model
and every existing head, initialises the new heads as copies of the trained ones (head j from
head ((j-1) mod m)+1), and trains only the new heads with the configured loss. A schedule of
(1, 8) is the one-shot block copy; (1, 2, 4, 8) is iterated doubling. Each stage has its own
workdir, so rerunning resumes the interrupted stage and skips finished ones.
"""

import copy
import os

import ml_collections

from mtpd_jax.harness import training


def stage_configs(config: ml_collections.ConfigDict, workdir: str) -> list[tuple[ml_collections.ConfigDict, str]]:
  """(config, workdir) of every stage of `config.looped.schedule`."""
  stages, prev_dir = [], None
  schedule = tuple(config.looped.schedule)
  for i, num_mtp_heads in enumerate(schedule):
    c = copy.deepcopy(config)
    c.model.num_mtp_heads = num_mtp_heads
    stage_dir = os.path.join(workdir, f'heads_{num_mtp_heads}')
    if i > 0:
      c.train.steps = config.looped.stage_steps
      c.train.trainable = list(range(schedule[i - 1] + 1, num_mtp_heads + 1))
      c.train.init_from, c.train.init_heads = prev_dir, 'loop'
    stages.append((c, stage_dir))
    prev_dir = stage_dir
  return stages


def run_looped(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True):
  """Train every stage in order; returns the last stage's (state, final metrics)."""
  return training.train_plan(stage_configs(config, workdir), progress=progress)


def __getattr__(name: str):
  if name == 'run_stages':  # renamed: it trains any plan of (config, workdir), not only a loop's stages
    raise AttributeError('looped.run_stages is now training.train_plan')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
