"""The `switchboard` command's entry point. `worker` goes to the worker's own parser before anything of the
server is imported: a worker talks to a server over REST, and importing the operator's commands (the store and
its 105 models) took a third of its start-up. Every other command goes to the operator's parser."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        os.umask(0o077)  # its state files are the owner's alone, as everything the operator's commands write
        from switchboard.worker.main import main as worker_main

        return worker_main(argv[1:])
    from switchboard.cli.parser import main as operator_main

    return operator_main(argv)
