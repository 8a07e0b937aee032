"""Thin wrapper: `python -m kvtier_bench transfer` (kvtier_bench.transfer) as a script of the checkout."""
from kvtier_bench.transfer import main

if __name__ == "__main__":
    main()
