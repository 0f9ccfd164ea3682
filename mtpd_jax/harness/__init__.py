"""The harness: everything that reads a config or the outside world and drives the core.

Config translation and validation, workdirs, the experiment protocol, looped stages, evaluation
and reports, the corpus, tokenizers, prompts and the GGUF import. It imports the core
(`mtpd_jax.*`); the core never imports it (docs/design.md, "Two layers"; tests/layers_test.py).
"""
