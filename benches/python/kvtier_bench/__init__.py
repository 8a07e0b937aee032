"""kvtier's benchmarks, run from a checkout (they are not part of the installed package):

    PYTHONPATH=python:benches/python python -m kvtier_bench pin|transfer|store|mooncake|tenants [options]
    PYTHONPATH=python:benches/python python -m kvtier_bench.transfer_probe|overlap_profile [options]

(with kvtier installed, ``PYTHONPATH=benches/python`` is enough). Each measures its hardware ceiling in the same run
and reports kvtier's figures as ratios to it. The trace replay, an operator's sizing tool, ships in the package:
``kvtier replay``."""
