"""``torchrun ... tests/die_at.py R:S0,S1 train ARGS``: ``fived train`` with the fault-injection
hook installed (``fived.testing.DieAt``: rank R SIGKILLs itself at step S_k of torchrun attempt
k). fived's own command line carries no test branch; this script is what the recovery tests
run under torchrun."""

import sys

from fived.cli.main import main
from fived.testing import DieAt
from fived.train.hooks import install

if __name__ == "__main__":
    install(DieAt(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
