"""Thin wrapper: `python -m kvtier_bench store` (kvtier_bench.store) as a script of the checkout."""
from kvtier_bench.store import main

if __name__ == "__main__":
    main()
