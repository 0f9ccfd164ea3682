"""Table 2 and Fig. 10 (K=1): the Top-N of the distilled logits.

The paper's N = 1 / 1,000 / 10,000 of a 122,880 vocabulary are 1 token, 0.8% and 8.1% of V;
here V = 8,192, so 1, 66 and 667. "10000x2" is read as the union of teacher and student top-N.
"""

from configs import paper

DEFAULT = 'Top N = 667 (8.1% V, default)'  # the reference of the other sizes' paired differences


def get_config(arg: str = ''):
  return paper.get_config(arg, num_mtp_heads=1)


def get_sweep():
  return [
      {'label': 'MTP', 'distill.enabled': False},
      {'label': 'Top N = 1', 'distill.top_n': 1},
      {'label': 'Top N = 66 (0.8% V)', 'distill.top_n': 66, 'reference': DEFAULT},
      {'label': DEFAULT, 'distill.top_n': 667},
      {'label': 'Top N = 667x2 (union)', 'distill.top_n': 667, 'distill.top_n_mode': 'union', 'reference': DEFAULT},
      {'label': 'whole vocabulary', 'distill.top_n': None, 'reference': DEFAULT},
  ]
