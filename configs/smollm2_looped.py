"""Looped extension on SmolLM2-135M-Instruct (Table 8, Figs. 3 and 5): one head drafted to depth 8.

Every row trains on the frozen pretrained trunk (configs/smollm2_mtpd.py). Rows: MTP-D with K=1;
the same head looped to draft depth 8 without training (MTP-D*: depth j reuses head 1); and
trained looping 1 -> 2 -> 4 -> 8, where each stage copies the trained heads and trains only the
copies. `smollm2_looped:quick` runs on two CPU cores in about 25 minutes. `smollm2_looped:cpu` is
the two-core recipe of smollm2_mtpd:cpu (the frozen trunk's cached states) at half
its steps per row and a quarter per looped stage. It does not fit 90 minutes yet and has not run to
the end: on 2026-12-06 its first row took 19.7 min to train and 18.3 min to evaluate, and every row
trains the same K=1 head again (the training-free row to evaluate it, the trained loop as its first
stage) before the loop's 2-, 4- and 8-head stages: an estimated 2.5 hours in all.
"""

from configs import smollm2_mtpd


def get_config(arg: str = ''):
  c = smollm2_mtpd.get_config(arg, num_heads=1)
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
