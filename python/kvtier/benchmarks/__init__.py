"""kvtier's benchmarks, runnable as ``kvtier bench pin|transfer|store`` or ``python -m kvtier.benchmarks.NAME``.
Each measures its hardware ceiling in the same run and reports kvtier's figures as ratios to it."""
