"""What ``kvtier demo`` runs, imported only by the command line (and the tests that run the demo's workload):

- :mod:`kvtier.demo.tour`: the main job, a short, verified tour of what kvtier does (``kvtier demo``);
- :mod:`kvtier.demo.cluster`: two inference nodes sharing one KV cache through a Mooncake cluster
  (``kvtier demo --cluster``);
- :mod:`kvtier.demo.workload`: the multi-turn workload both serve, on transformers' Llama
  (:mod:`kvtier.demo.workload_transformers`) or a toy transformer.

Nothing in the library imports this package.
"""
