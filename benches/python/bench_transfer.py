"""Thin wrapper: the benchmark lives in the package (kvtier.benchmarks.transfer) so `kvtier bench transfer` can run it."""
from kvtier.benchmarks.transfer import main

if __name__ == "__main__":
    main()
