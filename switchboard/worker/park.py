"""Quota parks (SPEC section 15, "Parking"): when a provider's quota walls, every worker on the host that shares
the quota group claims nothing until the park ends.

A park is one small JSON file per group in the state directory, `park-GROUP.json` = `{"until": <Unix seconds>,
"parks": <consecutive parks>}`, so it is shared by the group's workers on this host and survives a restart.
Writers hold `park-GROUP.lock` (flock) and replace the file atomically; readers need no lock. Standard library
only: the worker imports this at start-up."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

FIRST_PARK_SECONDS = 15 * 60  # a park without a retry time: 15 min, doubling per consecutive park ...
LONGEST_BACKOFF_SECONDS = 6 * 3600  # ... up to 6 h
LONGEST_PARK_SECONDS = 8 * 86400  # and no park, even one the child asked for, lasts more than 8 days
QUOTA_GROUP_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # a file name part: no path, no dot files


def backoff_seconds(parks: int) -> float:
    """The length of the `parks`-th consecutive park that named no retry time."""
    return min(FIRST_PARK_SECONDS * 2 ** min(parks - 1, 16), LONGEST_BACKOFF_SECONDS)


class QuotaPark:
    """The park of one quota group on this host."""

    def __init__(self, state_dir: Path, group: str):
        self.group = group
        self.path = state_dir / f"park-{group}.json"
        self.lock_path = state_dir / f"park-{group}.lock"

    def until(self, now: float) -> float | None:
        """When the current park ends (Unix seconds), or None when the group is not parked at `now`."""
        state = self._read()
        return state["until"] if state and state["until"] > now else None

    def park(self, retry_after: float | None, now: float) -> float:
        """Park the group from `now`: for `retry_after` seconds when given, else by the consecutive backoff.
        Returns when the park ends. Workers of the group that hit the wall together (a park already running)
        do not double it: a named retry time may only lengthen it."""
        with self._locked():
            state = self._read() or {"until": 0.0, "parks": 0}
            if state["until"] > now:
                parks = state["parks"]
                until = state["until"] if retry_after is None else max(state["until"], now + retry_after)
            else:
                parks = state["parks"] + 1
                until = now + (backoff_seconds(parks) if retry_after is None else retry_after)
            until = min(until, now + LONGEST_PARK_SECONDS)
            self._write({"until": until, "parks": parks})
        return until

    def served(self, now: float) -> None:
        """A job of the group ended without hitting the wall: the next park starts the doubling over. A park
        still running is left alone (that job may have started before it)."""
        if not self.path.exists():
            return
        with self._locked():
            state = self._read()
            if state is None or state["until"] <= now:
                self.path.unlink(missing_ok=True)

    def _read(self) -> dict | None:
        """The park file, or None when there is none. A file this module did not write (it writes whole files
        only) counts as no park rather than stopping the group's workers for good."""
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict):
            return None
        until, parks = state.get("until"), state.get("parks")
        if not isinstance(until, (int, float)) or isinstance(until, bool) or not isinstance(parks, int):
            return None
        return {"until": float(until), "parks": parks}

    def _write(self, state: dict) -> None:
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".park-{self.group}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(state, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
