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

from mtpd_jax import workdir_lock
from mtpd_jax.harness import training


def stage_configs(config: ml_collections.ConfigDict, workdir: str) -> list[tuple[ml_collections.ConfigDict, str]]:
  """(config, workdir) of every stage of `config.looped.schedule`."""
  stages, prev_dir = [], None
  schedule = tuple(config.looped.schedule)
  for i, num_heads in enumerate(schedule):
    c = copy.deepcopy(config)
    c.mtp.num_heads = num_heads
    stage_dir = os.path.join(workdir, f'heads_{num_heads}')
    if i > 0:
      c.train.steps = config.looped.stage_steps
      c.train.trainable = list(range(schedule[i - 1] + 1, num_heads + 1))
      c.train.init_from, c.train.init_heads = prev_dir, 'loop'
    stages.append((c, stage_dir))
    prev_dir = stage_dir
  return stages


def run_looped(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True):
  """Train every stage in order; returns the last stage's (state, final metrics)."""
  return run_stages(stage_configs(config, workdir), progress=progress)


def run_stages(stages: list[tuple[ml_collections.ConfigDict, str]], *, progress: bool = True):
  """Train each (config, workdir) in order, resuming or skipping what is done: a looped run's stages,
  or a sweep point's models (`experiment.training_plans`), some of which another point may be
  training in another process (then this one waits for it). Returns the last (state, final metrics).
  """
  result = None
  for config, workdir in stages:
    if len(stages) > 1:
      print(f'[looped] {config.mtp.num_heads} heads -> {workdir}', flush=True)
    with workdir_lock.hold(workdir, wait=True):
      result = training.train_and_evaluate(config, workdir, progress=progress)
  return result
