"""Thin wrapper: the benchmark lives in the package (kvtier.benchmarks.pin) so `kvtier bench pin` can run it."""
from kvtier.benchmarks.pin import main

if __name__ == "__main__":
    main()
