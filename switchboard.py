"""`python switchboard.py COMMAND …` from a checkout: the design's promise that a clone runs with no install step
beyond its dependencies. The code is the `switchboard` package beside this file (a package directory wins over a
module of the same name on import), and `pip install .` gives the same CLI as the `switchboard` command."""

import sys

from switchboard.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
