"""``accelerate launch -m headway.train --config configs/X.yaml [overrides]`` = ``headway train ...``."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
