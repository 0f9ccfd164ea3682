"""Both notebooks run headlessly with their quick parameters, and fail the test on any cell error."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, 'notebooks')


def run_notebook(name: str, tmp_path, monkeypatch, **parameters):
  """Execute notebooks/NAME with `parameters` injected after its `parameters` cell (papermill's way)."""
  import nbclient
  import nbformat
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  at = next(i for i, c in enumerate(nb.cells) if 'parameters' in c.metadata.get('tags', ()))
  nb.cells.insert(at + 1, nbformat.v4.new_code_cell('\n'.join(f'{k} = {v!r}' for k, v in parameters.items())))
  monkeypatch.setenv('JAX_NUM_CPU_DEVICES', '1')
  monkeypatch.setenv('MTPD_JAX_CACHE', str(tmp_path / 'cache'))
  # The kernel inherits conftest's XLA cache: both rows of a notebook compile the same programs.
  nbclient.NotebookClient(nb, timeout=900, kernel_name='python3',
                          resources={'metadata': {'path': NOTEBOOKS}}).execute()
  return nb


def _outputs(nb) -> str:
  texts = []
  for cell in nb.cells:
    for out in cell.get('outputs', ()):
      texts.append(out.get('text', ''))
      texts.extend(str(v) for k, v in out.get('data', {}).items() if k.startswith('text/'))
  return '\n'.join(texts)


def test_notebooks_are_committed_without_outputs():
  import nbformat
  for name in sorted(os.listdir(NOTEBOOKS)):
    if name.endswith('.ipynb'):
      nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
      code = [c for c in nb.cells if c.cell_type == 'code']
      assert all(not c.outputs and c.execution_count is None for c in code), name
      assert any('parameters' in c.metadata.get('tags', ()) for c in code), name


@pytest.mark.slow
def test_quickstart_runs_and_shows_tables_plots_decoding_and_speedup(tmp_path, monkeypatch):
  nb = run_notebook('quickstart.ipynb', tmp_path, monkeypatch, quick=True, runs_dir=str(tmp_path / 'runs'),
                    results_dir=str(tmp_path / 'results'))
  text = _outputs(nb)
  assert '| MTP |' in text and '| MTP-D |' in text
  images = sum('image/png' in out.get('data', {}) for c in nb.cells for out in c.get('outputs', ()))
  assert images == 2
  assert 'accepted drafts' in text
  assert text.count('lossless=True') == 6  # chat, code and math for each of the two rows
  for name in ('loss_curves.png', 'acceptance.png', 'results.md'):
    assert (tmp_path / 'results' / name).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.long  # about 14 minutes on 2 cores: each row compiles and decodes the 30-layer model
def test_real_model_notebook_trains_heads_on_smollm2_and_drafts_to_depth_8(tmp_path, monkeypatch):
  nb = run_notebook('real_model_heads.ipynb', tmp_path, monkeypatch, quick=True, runs_dir=str(tmp_path / 'runs'),
                    results_dir=str(tmp_path / 'results'), loop_depth=8)
  text = _outputs(nb)
  assert "'num_layers': 30" in text and '<|im_start|>user' in text  # the real model and its chat template
  assert '| MTP, K=4, frozen trunk |' in text and '| MTP-D, K=4, frozen trunk |' in text
  assert 'accepted drafts' in text
  assert text.count('**MTP, depth 8**') == 1 and text.count('**MTP-D, depth 8**') == 1
