"""Thin wrapper: the benchmark lives in the package (kvtier.benchmarks.store) so `kvtier bench store` can run it."""
from kvtier.benchmarks.store import main

if __name__ == "__main__":
    main()
