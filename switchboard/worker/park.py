"""Quota parks (SPEC sections 15 and 16, "Parking"): when a provider's quota walls, every worker on the host that
shares the quota group claims nothing until the park ends.

A park is one small JSON file per group in the state directory, `park-GROUP.json` = `{"until": <Unix seconds>,
"parks": <consecutive parks>}`, so it is shared by the group's workers on this host and survives a restart.
Writers hold `park-GROUP.lock` (flock) and replace the file atomically; readers need no lock. Standard library
only: the worker imports this at start-up.

The directory is the worker's own (check_state_dir refuses one that another user owns or that others may write),
and what is in it is still read as if hostile: only regular files, opened without following a link and without
blocking on a FIFO, at most PARK_FILE_BYTES of them, strict JSON whose `until` is a finite number. A park lasts at
least SHORTEST_PARK_SECONDS when it is written, and never more than LONGEST_PARK_SECONDS from when it was written
(the file's time) or from now, whichever is earlier, when it is read: a file that says 30 days, or the year 10000,
parks for 8 days at most."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from switchboard.worker.job import ConfigError

log = logging.getLogger("switchboard.worker")

SHORTEST_PARK_SECONDS = 60  # a park that names no time, 0, or one in the past still waits this long
FIRST_PARK_SECONDS = 15 * 60  # a park without a retry time: 15 min, doubling per consecutive park ...
LONGEST_BACKOFF_SECONDS = 6 * 3600  # ... up to 6 h
LONGEST_PARK_SECONDS = 8 * 86400  # and no park, even one the child asked for, lasts more than 8 days
PARK_FILE_BYTES = 4096  # a park file is a few dozen bytes; anything longer is not one of ours
QUOTA_GROUP_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # a file name part: no path, no dot files


def check_state_dir(path: Path) -> None:
    """Make the state directory (mode 0700) if it is missing; refuse one that is not a directory, that belongs to
    another user, or that group or others may write (they could plant a park that stops this worker, or a link
    that its writes would follow)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot make the state directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"the state directory {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"the state directory {path} belongs to uid {info.st_uid}, not to this worker's user"
                            f" (uid {os.geteuid()}): give the worker a directory of its own")
    if info.st_mode & 0o022:
        raise ConfigError(f"the state directory {path} is writable by group or others (mode"
                            f" {stat.S_IMODE(info.st_mode):04o}): run chmod 700 {path}")


def backoff_seconds(parks: int) -> float:
    """The length of the `parks`-th consecutive park that named no retry time."""
    return min(FIRST_PARK_SECONDS * 2 ** min(max(parks, 1) - 1, 16), LONGEST_BACKOFF_SECONDS)


def park_length(seconds: float) -> float:
    """A park's length as it is written: at least SHORTEST_PARK_SECONDS, at most LONGEST_PARK_SECONDS."""
    if not math.isfinite(seconds):
        return LONGEST_PARK_SECONDS if seconds > 0 else SHORTEST_PARK_SECONDS
    return min(max(seconds, SHORTEST_PARK_SECONDS), LONGEST_PARK_SECONDS)


def open_regular(path: Path, flags: int, mode: int = 0o600) -> int:
    """A descriptor of `path` when it is a regular file, opened without following a symbolic link (ELOOP) and
    without waiting on a FIFO; OSError otherwise (EINVAL for anything that is not a regular file)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


class QuotaPark:
    """The park of one quota group on this host."""

    def __init__(self, state_dir: Path, group: str):
        self.group = group
        self.path = state_dir / f"park-{group}.json"
        self.lock_path = state_dir / f"park-{group}.lock"
        self._complaint: str | None = None  # the last problem logged about the park file, so it is logged once

    def until(self, now: float) -> float | None:
        """When the current park ends (Unix seconds), or None when the group is not parked at `now`."""
        state = self._read(now)
        return state["until"] if state and state["until"] > now else None

    def park(self, retry_after: float | None, now: float) -> float:
        """Park the group from `now`: for `retry_after` seconds when given (within SHORTEST_PARK_SECONDS and
        LONGEST_PARK_SECONDS), else by the consecutive backoff. Returns when the park ends. Workers of the group
        that hit the wall together (a park already running) do not double it: a named retry time may only
        lengthen it. When the file cannot be written the park still holds for this worker (and is logged)."""
        try:
            with self._locked():
                return self._park(retry_after, now)
        except OSError as exc:
            log.error("quota group %s: cannot keep the park in %s (%s): this worker alone is parked", self.group,
                      self.path.parent, exc.strerror or exc)
            return now + park_length(backoff_seconds(1) if retry_after is None else retry_after)

    def _park(self, retry_after: float | None, now: float) -> float:
        state = self._read(now) or {"until": 0.0, "parks": 0}
        if state["until"] > now:
            parks = state["parks"]
            until = state["until"] if retry_after is None else max(state["until"], now + park_length(retry_after))
        else:
            parks = state["parks"] + 1
            until = now + park_length(backoff_seconds(parks) if retry_after is None else retry_after)
        self._write({"until": until, "parks": parks})
        return until

    def served(self, now: float) -> None:
        """A job of the group ended without hitting the wall: the next park starts the doubling over. A park
        still running is left alone (that job may have started before it)."""
        if not os.path.lexists(self.path):
            return
        try:
            with self._locked():
                state = self._read(now)
                if state is None or state["until"] <= now:
                    self.path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("quota group %s: cannot clear the park in %s (%s)", self.group, self.path.parent,
                      exc.strerror or exc)

    def _read(self, now: float) -> dict | None:
        """The park file, or None when there is none. A file this module did not write (it writes whole files
        only) counts as no park, logged once, rather than stopping the group's workers for good."""
        try:
            fd = open_regular(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._complaint = None
            return None
        except OSError as exc:
            return self._ignored(f"cannot be read: {exc.strerror or exc}")
        try:
            written = os.fstat(fd).st_mtime
            data = os.read(fd, PARK_FILE_BYTES + 1)
        except OSError as exc:
            return self._ignored(f"cannot be read: {exc.strerror or exc}")
        finally:
            os.close(fd)
        if len(data) > PARK_FILE_BYTES:
            return self._ignored(f"is over {PARK_FILE_BYTES} bytes")
        try:
            state = json.loads(data, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            return self._ignored("is not JSON")
        until = state.get("until") if isinstance(state, dict) else None
        parks = state.get("parks") if isinstance(state, dict) else None
        try:
            until = float(until) if isinstance(until, (int, float)) and not isinstance(until, bool) else math.nan
        except OverflowError:  # an integer past any float
            until = math.nan
        if not math.isfinite(until) or not isinstance(parks, int) or isinstance(parks, bool):
            return self._ignored('is not {"until": <seconds>, "parks": <count>}')
        self._complaint = None
        # Never longer than 8 days from when it was written, nor from now (a file from the future, a clock skew).
        return {"until": min(until, min(written, now) + LONGEST_PARK_SECONDS), "parks": min(max(parks, 0), 64)}

    def _ignored(self, problem: str) -> None:
        if problem != self._complaint:
            self._complaint = problem
            log.warning("quota group %s: the park file %s %s: ignored", self.group, self.path, problem)
        return None

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
        fd = open_regular(self.lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
