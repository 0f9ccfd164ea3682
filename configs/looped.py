"""Table 8 and Figs. 3 and 5: looped extension to 8 heads, against 1-head MTP.

Rows: 1-head MTP (the baseline), MTP-D with K=1 and K=4, training-free looping to depth 8 of the
K=1 MTP-D head (MTP-D*) and, as its control, of the K=1 MTP head (MTP*; the paper's finding (iv),
third-head CAR 26.70% against 0.60% on AGIEval-en in Fig. 3, is about this pair), and trained
looping 1 -> 2 -> 4 -> 8 (each stage copies the trained heads, freezes everything else and trains
the copies) with the MTP and with the MTP-D loss.
"""

from configs import paper


def get_config(arg: str = ''):
  c = paper.get_config(arg, num_mtp_heads=1)
  c.looped.stage_steps = c.train.steps // 2
  return c


def get_sweep():
  trained = {'looped.schedule': (1, 2, 4, 8), 'eval.draft_depth': 8}
  return [
      {'label': 'MTP, K=1 (baseline)', 'distill.enabled': False},
      {'label': 'MTP-D, K=1', 'distill.enabled': True},
      {'label': 'MTP-D, K=4', 'model.num_mtp_heads': 4},
      {'label': 'MTP*, 1 to 8 (training-free)', 'distill.enabled': False, 'eval.draft_depth': 8},
      # Paired against its control, so the report's interval measures finding (iv) directly.
      {'label': 'MTP-D*, 1 to 8 (training-free)', 'eval.draft_depth': 8,
       'reference': 'MTP*, 1 to 8 (training-free)'},
      {'label': 'MTP, 1 to 8 (trained)', 'distill.enabled': False, **trained},
      {'label': 'MTP-D, 1 to 8 (trained)', **trained, 'reference': 'MTP, 1 to 8 (trained)'},
  ]
