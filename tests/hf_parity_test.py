"""Our GGUF import against an independent implementation: transformers + PyTorch on the same file."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # loading both models and compiling ours takes ~1 min on 2 cores


def test_logits_and_token_ids_match_transformers_on_smollm2(tmp_path):
  # Its own process, as a user runs it: PyTorch next to a test process's many JAX threads and
  # eight fake devices ran ~5x slower.
  out = tmp_path / 'hf_parity.json'
  proc = subprocess.run([sys.executable, '-m', 'benchmarks.hf_parity', f'--out={out}'], check=False, cwd=ROOT,
                        capture_output=True, text=True, timeout=900,
                        env={**os.environ, 'JAX_NUM_CPU_DEVICES': '1', 'HF_HUB_OFFLINE': '1'})
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert f"max_abs_logit_diff={result['max_abs_logit_diff']}" in proc.stdout.splitlines()[-1]
  assert result['tokens_equal'], result['tokens_equal_per_prompt']  # plain texts and the ChatML prompt
  assert result['prompts'] == 4 and result['positions'] > 100
  # f32 on both sides; a layout or RoPE mistake shows up as O(1) differences.
  assert result['max_abs_logit_diff'] < 1e-3, result['max_abs_logit_diff_per_prompt']
  assert result['top1_agreement'] == 1.0
