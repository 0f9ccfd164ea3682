"""Table 6 (K=4): "ensemble mean", read as a teacher that averages every earlier predictor of the
same token (the main head and heads 1..k-1), against the main head alone (our reading: docs/design.md, "Choices where the paper is silent")."""

from configs import paper


def get_config(arg: str = ''):
  return paper.get_config(arg, num_mtp_heads=4)


def get_sweep():
  return [
      {'label': 'main-head teacher (MTP-D)', 'distill.teacher': 'main'},
      {'label': 'ensemble mean', 'distill.teacher': 'ensemble_mean', 'train.loss_chunk_rows': 0},  # the fused loss needs the main head
  ]
