"""`python -m switchboard COMMAND …`: the same CLI as the `switchboard` command."""

import sys

from switchboard.cli.entry import main

sys.exit(main())
