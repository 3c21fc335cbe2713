"""Integrations of polysketch with other libraries (imported lazily, never by ``polysketch``).

* ``polysketch.integrations.transformers``: convert Hugging Face causal LMs to kernelized
  attention, decode them from a constant-size state, and linearize pretrained softmax models
  (needs the ``hf`` extra: ``pip install polysketch[hf]``).
"""
