"""Measurement: what the CLI runs (``approx``, ``bench``, ``demo``, ``linearize``, ``mqar``).

* ``fidelity/``: how well feature maps reproduce their kernels (metrics, ``evaluate_map``,
  ``sweep``, q/k sources and capture, the softmax-estimator angle sweep, ``polysketch approx``);
* ``bench/``: speed against softmax attention (attention, whole models, cost model, timing);
* ``demo/``: the report of ``polysketch demo``;
* ``mqar_sweep``: recall vs decode-state size (``polysketch mqar``);
* ``linearize_report``: the results of ``polysketch linearize``;
* ``plots`` (matplotlib, the ``plot`` extra, imported only to draw) and ``tables`` (text).
"""
