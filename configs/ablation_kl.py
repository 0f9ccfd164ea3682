"""Table 2's caption and Fig. 9 (K=1): forward KL(teacher ‖ student) against reverse KL."""

from configs import paper


def get_config(arg: str = ''):
  return paper.get_config(arg, num_mtp_heads=1)


def get_sweep():
  return [
      {'label': 'forward KL (default)', 'distill.kl': 'forward'},
      {'label': 'reverse KL', 'distill.kl': 'reverse'},
  ]
