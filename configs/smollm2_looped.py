"""Looped extension on SmolLM2-135M-Instruct (Table 8, Figs. 3 and 5): one head drafted to depth 8.

Every row trains on the frozen pretrained trunk (configs/smollm2_mtpd.py). Rows: MTP-D with K=1;
the same head looped to draft depth 8 without training (MTP-D*: depth j reuses head 1); and
trained looping 1 -> 2 -> 4 -> 8, where each stage copies the trained heads and trains only the
copies. A sweep trains the K=1 head once: the training-free row evaluates it, and the trained
loop continues from it (experiment.training_plans). `smollm2_looped:cpu` is the two-core recipe of
smollm2_mtpd:cpu (the frozen trunk's cached states and teacher, heads over its head vocabulary)
with one head, 200 steps, and a loop to depth 4 (1 -> 2 -> 4, 50 steps per stage): depth 8 would
add two more evaluated depths and a stage of eight heads. Its times are in docs/results.md; the
run published there predates the head vocabulary.
"""

from configs import smollm2_mtpd


def get_config(arg: str = ''):
  c = smollm2_mtpd.get_config(arg, num_mtp_heads=1)
  c.looped.stage_steps = c.train.steps // 2
  if arg == 'cpu':
    c.train.steps, c.looped.stage_steps = 200, 50
  return c


def get_sweep(arg: str = ''):
  schedule = (1, 2, 4) if arg == 'cpu' else (1, 2, 4, 8)
  depth = schedule[-1]
  return [
      {'label': 'MTP-D, K=1'},
      {'label': f'MTP-D*, 1 to {depth} (training-free)', 'eval.draft_depth': depth},
      {'label': f'MTP-D, 1 to {depth} (trained)', 'looped.schedule': schedule,
       'eval.draft_depth': depth},
  ]
