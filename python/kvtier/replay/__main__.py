"""``python -m kvtier.replay [options]``: the same as ``kvtier replay [options]``."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["replay", *sys.argv[1:]]))
