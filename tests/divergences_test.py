"""The divergence table: for every measure, its hand-written derivative gives the student's gradient
that autodiff gives of the same terms, renormalised over a selection and as a partial sum over V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpd_jax import divergences, losses

from conftest import distinct_logits


@pytest.mark.parametrize('renormalize', [True, False])
@pytest.mark.parametrize('measure', list(divergences.TABLE))
def test_the_student_gradient_of_every_measure_is_autodiffs(measure, renormalize):
  t_RxV, s_RxV = distinct_logits(3, (6, 40), scale=8.0), distinct_logits(4, (6, 40), scale=8.0)
  sel_RxV = divergences.selection_mask(t_RxV, losses.top_n_threshold(t_RxV, 9))

  def total(s):  # Σ over the selection of the measure's terms, rows weighted differently
    logq, logp, _, _ = divergences.masked_log_probs(t_RxV, s, sel_RxV, renormalize)
    terms = divergences.terms(logq, logp, measure)
    return jnp.sum(jnp.arange(1.0, 7.0) * jnp.sum(terms if renormalize else terms * sel_RxV, axis=-1))
  want = jax.grad(total)(s_RxV)
  logq, logp, _, _ = divergences.masked_log_probs(t_RxV, s_RxV, sel_RxV, renormalize)
  got = jnp.arange(1.0, 7.0)[:, None] * divergences.student_gradient(logq, logp, 1.0 if renormalize else sel_RxV,
                                                                      measure)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()))  # f32 rounding
  assert float(jnp.abs(want).max()) > 1e-3  # the case is not degenerate


def test_an_unknown_measure_is_named():
  with pytest.raises(ValueError, match="unknown divergence measure 'hellinger'"):
    divergences.terms(jnp.zeros(3), jnp.zeros(3), 'hellinger')
