"""Small, plausible bugs in the core, each with the tests that must catch it (`make mutate`).

A mutant replaces `old` (which must occur exactly once in `path`) by `new`. `tests` are pytest node
ids; the mutant is caught when one of them fails. An `equivalent` mutant changes nothing a test
could see: the reason says why, and `make mutate` expects it to survive. Add a mutant for every
class of bug a review finds; a survivor that is not equivalent needs a test.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  path: str
  old: str
  new: str
  tests: tuple[str, ...]
  equivalent: str = ''


DECODE = 'tests/decode_test.py::'
LOSSES = 'tests/losses_test.py::'

MUTANTS = (
    # Decoding: the head caches' refresh window, adaptive depth's accounting, the draft vocabulary.
    Mutant('draft window one position short (harmless at J >= 2)', 'mtpd_jax/decode.py',
           'jnp.maximum(new.length_B - 1 - 2 * j, 0), 2 * j,', 'jnp.maximum(new.length_B - 2 * j, 0), 2 * j - 1,',
           (DECODE + 'test_online_greedy_acceptance_equals_teacher_forced_chains[1]',
            DECODE + 'test_kv_cache_decoding_matches_full_recomputation[1]')),
    Mutant('greedy verify counts unproposed drafts', 'mtpd_jax/verify.py',
           'ok_BxPathsxJ &= proposed_BxNodes[:, tree.path_nodes[:, 1:]]', 'pass',
           (DECODE + 'test_adaptive_depth_never_accepts_a_draft_it_did_not_propose[0.0]',)),
    Mutant('sampled verify counts unproposed drafts', 'mtpd_jax/verify.py',
           'drawn_B = trying_B if proposed_BxNodes is None else trying_B & at_node(proposed_BxNodes, m_B)',
           'drawn_B = trying_B',
           (DECODE + 'test_adaptive_depth_never_accepts_a_draft_it_did_not_propose[1.0]',)),
    Mutant('draft index mapped to the next vocabulary id', 'mtpd_jax/drafting.py',
           'else vocab.ids_U[drafts_ParentsxChildren]',
           'else jnp.roll(vocab.ids_U, 1)[drafts_ParentsxChildren]',
           (DECODE + 'test_a_draft_vocabulary_holding_every_drafted_id_accepts_exactly_as_the_full_vocabulary[tree0]',)),
    Mutant('draft index read as a token id', 'mtpd_jax/drafting.py',
           'else vocab.ids_U[drafts_ParentsxChildren]', 'else drafts_ParentsxChildren',
           (DECODE + 'test_a_draft_vocabulary_holding_every_drafted_id_accepts_exactly_as_the_full_vocabulary[tree1]',)),
    Mutant('greedy bonus token read one position early', 'mtpd_jax/verify.py',
           'end_B = jnp.asarray(tree.path_nodes)[path_B, a_B]',
           'end_B = jnp.asarray(tree.path_nodes)[path_B, jnp.minimum(a_B, len(tree.branching) - 1)]',
           (DECODE + 'test_speculative_greedy_equals_plain_greedy[2-stop1]',)),
    Mutant('residual max(0, q - p) instead of max(0, p - q)', 'mtpd_jax/sampling.py',
           'r_BxV = jnp.maximum(p_BxV - q_BxV, 0.0)', 'r_BxV = jnp.maximum(q_BxV - p_BxV, 0.0)',
           (DECODE + 'test_speculative_sampling_is_lossless_and_catches_wrong_rules[None]',)),
    # Trees.
    Mutant('tree keeps the path that accepted least', 'mtpd_jax/verify.py',
           'path_B = jnp.argmax(a_BxPaths, axis=1)', 'path_B = jnp.argmin(a_BxPaths, axis=1)',
           (DECODE + 'test_tree_greedy_equals_plain_greedy_and_accepts_at_least_the_chain[tree1]',)),
    Mutant('a tree node sees itself but not its ancestors', 'mtpd_jax/drafting.py',
           'ancestor_NodesxNodes[node, path_nodes[p, :j + 1]] = True',
           'ancestor_NodesxNodes[node, path_nodes[p, j]] = True',
           (DECODE + 'test_the_tree_pass_gives_each_path_what_a_chain_verify_of_its_drafts_gives[tree0]',)),
    Mutant('keep_path compacts path 0 whatever won', 'mtpd_jax/verify.py',
           'jnp.asarray(tree.path_nodes)[path_B, 1:]', 'jnp.asarray(tree.path_nodes)[0 * path_B, 1:]',
           (DECODE + 'test_tree_caches_hold_exactly_the_committed_tokens_states',)),
    Mutant('sampled tree tests siblings against the full p', 'mtpd_jax/verify.py',
           'sampling.residual(p_BxV, q_BxV), p_BxV)', 'p_BxV, p_BxV)',
           (DECODE + 'test_sampled_tree_is_lossless_and_catches_siblings_tested_without_the_residual[tree0-kwargs0-False]',)),
    # The loss.
    Mutant('forward KL weighted by the student', 'mtpd_jax/divergences.py',
           "lambda logq, logp: jnp.exp(logq) * (logq - logp)", "lambda logq, logp: jnp.exp(logp) * (logq - logp)",
           (LOSSES + 'test_whole_vocabulary_kl_matches_numpy',)),
    Mutant('head CE weight lambda instead of lambda/K', 'mtpd_jax/losses.py',
           'loss += ce_weight / num_mtp_heads * ce_k', 'loss += ce_weight * ce_k',
           (LOSSES + 'test_mtp_d_loss_total_and_metrics_match_their_parts',)),
    Mutant('head k trained on the target of head k-1', 'mtpd_jax/losses.py',
           'xent(student_BxTxV, shift_left(targets_BxT, k))', 'xent(student_BxTxV, shift_left(targets_BxT, k - 1))',
           (LOSSES + 'test_mtp_d_loss_total_and_metrics_match_their_parts',)),
    Mutant('threshold path reads the teacher one row early', 'mtpd_jax/losses.py',
           'main_t_BxTxV, main_thr_BxT, main_lse_BxT, k', 'main_t_BxTxV, main_thr_BxT, main_lse_BxT, k - 1',
           (LOSSES + 'test_threshold_loss_and_gradients_equal_top_k[kw0]',)),
    Mutant('hand-written reverse-KL derivative drops the +1', 'mtpd_jax/divergences.py',
           'jnp.exp(logp) * (logp - logq + 1.0)', 'jnp.exp(logp) * (logp - logq)',
           ('tests/divergences_test.py::test_the_student_gradient_of_every_measure_is_autodiffs[reverse-False]',
            LOSSES + 'test_threshold_loss_and_gradients_equal_top_k[kw3]')),
    Mutant('the student gradient forgets the softmax term off the selection', 'mtpd_jax/divergences.py',
           'return g_V - jnp.exp(logp) * jnp.sum(g_V, axis=-1, keepdims=True)', 'return g_V',
           ('tests/divergences_test.py::test_the_student_gradient_of_every_measure_is_autodiffs[forward-True]',
            'tests/fused_loss_test.py::test_fused_loss_from_hidden_states_equals_the_loss_of_the_logits[kw0]')),
    Mutant('agreement metric compares with the main head at i+k-1', 'mtpd_jax/losses.py',
           'idx_BxTx1 = shift_left(main_argmax_BxT, k)[..., None]', 'idx_BxTx1 = shift_left(main_argmax_BxT, k - 1)[..., None]',
           (LOSSES + 'test_agreement_metric_counts_argmax_matches_with_the_main_head_at_i_plus_k',)),
    Mutant('redundant stop_gradient on the threshold teacher', 'mtpd_jax/losses.py',
           'main_t_BxTxV = (lax.stop_gradient(logits_BxTxV) if detach else logits_BxTxV)',
           'main_t_BxTxV = (logits_BxTxV if detach else logits_BxTxV)',
           (LOSSES + 'test_teacher_gradient_is_zero_with_detach_and_nonzero_without',),
           equivalent="the custom VJP of _detached_divergence already gives the teacher a zero cotangent"),
    # Top-N.
    Mutant('threshold search keeps N+1 entries', 'mtpd_jax/top_n.py',
           'up, down = active & (cnt >= n), active & (cnt < n)', 'up, down = active & (cnt > n), active & (cnt <= n)',
           ('tests/top_n_test.py::test_threshold_selects_exactly_the_top_k_set_of_distinct_logits',)),
    # Acceptance metrics.
    Mutant('CAR counts the steps that reached depth k', 'mtpd_jax/metrics.py',
           'accepted_J = np.sum(a_Steps[:, None] >= k_J, axis=0)', 'accepted_J = np.sum(a_Steps[:, None] >= k_J - 1, axis=0)',
           ('tests/metrics_test.py::test_acceptance_stats_on_a_hand_made_pattern',)),
    Mutant('teacher-forced agreement one position early', 'mtpd_jax/metrics.py',
           '== main_BxT[:, k:]', '== main_BxT[:, k - 1:t - 1]',
           ('tests/metrics_test.py::test_teacher_forced_agreement_and_chains_by_hand',)),
    Mutant('per-prompt accepted_1 counts every step', 'mtpd_jax/metrics.py',
           "'accepted_1': [int(np.sum(x >= 1)) for x in a]", "'accepted_1': [int(np.sum(x >= 0)) for x in a]",
           ('tests/metrics_test.py::test_per_prompt_counts_are_the_sums_that_give_each_prompts_ar1_and_tokens_per_forward',)),
    # The report's paired differences.
    Mutant('seeds paired by position', 'mtpd_jax/harness/paired.py',
           'pairs = [(mine[s], theirs[s]) for s in seeds]',
           'pairs = list(zip(mine.values(), theirs.values()))',
           ('tests/report_test.py::test_seeds_pair_by_id_and_a_seed_missing_on_one_side_is_left_out_with_a_warning',)),
)
