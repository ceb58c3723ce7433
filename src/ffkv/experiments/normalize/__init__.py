"""`ffkv normalize`: normalized vs unnormalized memories, measured on the model's own FFNs.

The paper's §2 reads a FFN as a key-value memory without the softmax. This step tests five claims
about what a normalization would do (seed 004), on held-out text (default `wikipedia:valid`):
C1 softmax concentrates the weight on a few slots; C2 so it degrades as the slots grow; C3 an
unnormalized ReLU memory's output variance grows like n/2; C4 a ReLU scaled by 1/(γ·√(n/2))
keeps it constant; C5 a key-value memory followed by a layer norm is a FFN. The verdicts are in
`ffkv.report.normalize`.

Text. Sentences of the corpus in its seeded order: the evaluation split (`tokens`) first, then,
from the next document on, the fit split (`fit_tokens`); τ and every scale are fit on the fit
split and everything is reported on the evaluation split. The first `sweep_tokens` of the
evaluation split also get the capacity sweep and the variance on the model.

Variants (`variants.py`): a layer's coefficient vector m becomes m', its output m'·V + b.
softmax: s·softmax(m/τ), for gated FFNs s·sign(m)⊙softmax(|m|/τ); scaled_relu: the activation
replaced by ReLU (gated: ReLU(x·g)·(x·u)), times 1/(γ·√(d_m/2)); original: m on the kept slots.
τ is a grid value (1/16…256 × the layer's RMS |m|, half-octave steps) chosen for the smallest
relative squared error of the output; s and γ make the output's RMS norm equal the original's
(one number per layer: the layer-norm reading of C5).

Substitution (`tail.py`): one layer at a time; the blocks below it are not rerun: the residual
stream cached by one intact forward per batch is reused and only blocks ℓ+1..L−1 (and the
model's own final norm and head) run. Loss = mean −log p(next token) over the predicted positions
of the evaluation sentences (each sentence its own context). Intervals: standard errors
clustered by sentence, of paired differences against the intact model.

Tables (public contract):
- `normalize_sentences`: sentence_id int64, doc_id int64, split string (eval | fit), in_sweep bool,
  text string, token_ids list<int32>, n_tokens int32. Evaluation sentences first, in order.
- `normalize_layers`: one row per layer × variant (softmax | scaled_relu): layer int16, variant,
  d_m int32, gated bool, tau (softmax; null otherwise), tau_rel (τ / RMS |m|), scale (the factor on
  the normalized coefficients: s, or 1/(γ·√(d_m/2))), gamma (scaled_relu), fit_rel_err and
  eval_rel_err (Σ‖y' − y‖² / Σ‖y − b‖² on each split), loss, loss_intact, delta_loss,
  delta_loss_se, ppl, ppl_intact (nats and perplexity on the evaluation split), tokens int64
  (predicted positions), sentences int32; concentration on the evaluation tokens, for the model's
  own coefficients (`_m`: p = |m|/Σ|m|) and the variant's (`_w`: p = |m'|/Σ|m'|), means over
  tokens: entropy_m, entropy_w (nats), top1_m, top1_w, top10_m, top10_w, top100_m, top100_w (share
  of p on the k largest slots), and entropy_diff_se, top1_diff_se, top10_diff_se, top100_diff_se
  (SE of the paired mean difference _w − _m); entropy_uniform = log d_m.
- `normalize_capacity`: per capacity layer × selection (random: one fixed draw of n slots; top: each
  token's n largest |m|) × n (…, d_m): layer int16, selection, n int32, tau, tau_rel, scale (the
  softmax variant's fit over the n slots), loss_softmax, loss_original (the model's own activation
  on the n slots, unscaled), loss_intact, gap = loss_softmax − loss_original, gap_se, gap_change =
  gap − gap at the smallest n, gap_change_se, fit_rel_err_softmax, fit_rel_err_original, tokens
  int64, sentences int32 (the sweep's). At n = d_m both selections keep every slot: the softmax
  variant is the full one and the original is the intact model.
- `normalize_variance`: source string (synthetic | model), layer int16 (null for synthetic),
  n int32 (slots summed), kind string (raw | scaled: divided by γ²·n/2), variance, se, expected
  (synthetic: n/2 raw, 1/γ² scaled; null for the model), draws int64 (samples, or tokens ×
  subsets), repeats int32 (random subsets per size), gamma. See `variance.py`.
"""
from __future__ import annotations

from ffkv.experiments.normalize.step import (DEFAULT_CORPUS, STEP, TABLES, NormalizeSettings,  # noqa: F401
                                             normalize, plan_of, reproduce_settings, split)
