"""`python -m switchboard.worker`: the worker without the rest of the CLI."""

import sys

from switchboard.worker.main import main

sys.exit(main())
