"""`python -m k3.train ARGS` = `k3 train ARGS`; what `k3 train --nproc N` runs under torchrun."""

import sys

from k3.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
