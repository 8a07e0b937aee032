"""kvtier's demo, run from a source checkout (the installed package holds none of it): ``make demo``, or
``PYTHONPATH=python:examples python -m kvtier_demo [options]`` (``--help`` lists them; no torch needed for it):

- :mod:`kvtier_demo.tour`: the main job, a short, verified tour of what kvtier does (``python -m kvtier_demo``);
- :mod:`kvtier_demo.cluster`: two inference nodes sharing one KV cache through a Mooncake cluster
  (``python -m kvtier_demo --cluster``);
- :mod:`kvtier_demo.workload`: the multi-turn workload both serve, on transformers' Llama
  (:mod:`kvtier_demo.workload_transformers`) or a toy transformer.

kvtier imports nothing of this package; it imports only kvtier's public API, plus the small helpers the library's
own commands use (``kvtier._cleanup``, ``kvtier._progress``).
"""
