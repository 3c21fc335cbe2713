"""Long-context measurements (issue 21 §1), run by ``benchmarks/long_context.py``.

One concept per module:

- ``retrieval``: weight on the matching key among t keys, from features (no t × t matrix),
  with its naive reference; ``kernels`` builds a spec's kernel (fitting learnable maps),
  ``inputs`` the q/k (LayerNorm'd Gaussians, captured heads, near queries),
  ``retrieval_table`` runs the table, ``retrieval_report`` writes it; ``retrieval_cli``.
- ``repeat_probe``: loss on a passage's recurrence vs its first occurrence, counterfactual,
  and the ablation (``polysketch.nn.ablate_global``: a mixed attention's far blocks or the
  global branch beside a local window switched off); ``probe_training`` trains the
  probed models with ``polysketch.train.train``; ``repeat_cli``.
- ``positions``: loss by position bucket on long documents, extrapolation; ``positions_cli``.
- ``mqar_cli``: long-range MQAR through ``polysketch.eval.mqar_sweep``'s long settings.
- ``timing``: seconds per training step; ``timing_cli``.
- ``report`` (resumable CSVs, markdown) and ``cli`` (shared options and errors).
"""
