"""mtpd_jax: multi-token-prediction heads trained by self-distillation (MTP-D), in JAX and Flax NNX.

The core (this package's modules) never reads a config; the harness (`mtpd_jax.harness`) translates
one into the core's frozen dataclasses (docs/design.md, "Two layers").

Dimension legend, the one for every module: an array's name ends in its axes (`logits_BxTxV`),
and einsum strings use the same letters in lower case. A letter means one kind of axis everywhere;
a digit after it adds that many (`J1` = J + 1), a leading digit multiplies (`2D`), and a function
that works over any leading axes names only the trailing ones it reads (`probs(logits_V)`).

  A  experts chosen per token (the router's top-k)     N  top-N entries of a row (the paper's N)
  B  batch: sequences, or prompts                      P  prompt positions
  C  capacity slots of an expert                       Q  query heads per kv head (H / G)
  D  model width                                       R  rows: positions flattened over the batch
  E  attention head width                              S  key positions (KV-cache slots)
  F  MLP or expert width                               T  query positions
  G  kv heads                                          U  draft-vocabulary entries
  H  attention heads                                   V  vocabulary
  I  decoding steps                                    W  positions of one decoding step's window
  J  draft depth (drafts per speculative step)         X  routed experts
  K  MTP heads (K1: the main head and the K heads)     Y  groups of consecutive rows (loss chunks,
  L  layers                                               MoE routing groups)
  M  ensemble members (the ensemble-mean teacher)      Z  bootstrap resamples
  O  nodes of a draft tree (drafting.py)
"""
