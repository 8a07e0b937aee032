"""Thin wrapper: `python -m kvtier_bench pin` (kvtier_bench.pin) as a script of the checkout."""
from kvtier_bench.pin import main

if __name__ == "__main__":
    main()
