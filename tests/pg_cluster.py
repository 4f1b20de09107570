"""A throw-away PostgreSQL cluster for tests: initdb into a temporary directory, a server on a free loopback port
(its unix socket in that directory too), trust authentication, and settings that only trade durability for speed
(fsync and full-page writes off: a crash loses the cluster, which a test throws away anyway). The tests that need
it ask `available()` first; `start()` gives a Cluster, `stop()` ends it and removes its directory.

The test suite's clusters live in memory (`start(in_memory=True)`: /dev/shm when it is a tmpfs with room). Every
test makes a database, and on this machine's disk (ext4 mounted with `discard`) CREATE DATABASE cost 125–220 ms
of kernel time, where on tmpfs it costs 17 ms: a Postgres run took 797 CPU-seconds where it took 939. Benchmarks
keep the disk, since they measure durable commits."""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# Debian's layout: the server's programs live per major version, and only some are linked onto PATH.
DEBIAN_BINARIES = "/usr/lib/postgresql/*/bin"
# Settings for a cluster nobody keeps: none changes what a query returns or which transaction wins.
SETTINGS = {
    "fsync": "off",
    # a test's database lives seconds: autovacuum's rounds through hundreds of them were CPU for nothing, and
    # statistics gathered halfway through a test would change its plans from one run to the next
    "autovacuum": "off",
    "full_page_writes": "off",
    "jit": "off",  # test_bulk.py and test_query_plans.py: 40 s without it, 44-50 s with it
    "max_connections": "200",
    "shared_buffers": "64MB",
    "listen_addresses": "'127.0.0.1'",
    "log_min_messages": "warning",
    "max_wal_size": "'256MB'",  # WAL recycled early: a cluster in memory holds little besides its databases
}
IN_MEMORY = Path("/dev/shm")
IN_MEMORY_ROOM = 2 << 30  # bytes free on it before a cluster goes there: three clusters' WAL and live databases
START_ATTEMPTS = 3  # a free port found by binding can be taken by someone else before the server binds it
TIMEOUT_S = 60


def _binaries() -> dict[str, str] | None:
    """initdb and pg_ctl from one directory: PATH first, then Debian's per-version directories (newest first)."""
    found = {name: shutil.which(name) for name in ("initdb", "pg_ctl")}
    if all(found.values()):
        return found
    for directory in sorted(glob.glob(DEBIAN_BINARIES), key=lambda d: int(Path(d).parent.name)
                            if Path(d).parent.name.isdigit() else 0, reverse=True):
        found = {name: os.path.join(directory, name) for name in ("initdb", "pg_ctl")}
        if all(os.access(path, os.X_OK) for path in found.values()):
            return found
    return None


def _as_root() -> bool:
    return os.geteuid() == 0


def available() -> str | None:
    """None when a cluster can be started here, else why not."""
    if _binaries() is None:
        return "needs the Debian package postgresql (initdb and pg_ctl not found)"
    if _as_root():
        try:
            import pwd
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root needs the user postgres (the Debian package postgresql makes it)"
    return None


def _in_memory_directory() -> str | None:
    """/dev/shm when it is a tmpfs with room (a container's default is 64 MiB, too small), else None (the
    default temporary directory)."""
    try:
        stat = os.statvfs(IN_MEMORY)
        with open("/proc/mounts") as mounts:
            tmpfs = any(line.split()[1:3] == [str(IN_MEMORY), "tmpfs"] for line in mounts)
    except OSError:
        return None
    return str(IN_MEMORY) if tmpfs and stat.f_bavail * stat.f_frsize >= IN_MEMORY_ROOM else None


def _run(*command: str) -> subprocess.CompletedProcess:
    """A server program, as the postgres user when we are root (the server refuses to run as root)."""
    prefix = ("runuser", "-u", "postgres", "--") if _as_root() else ()
    return subprocess.run((*prefix, *command), capture_output=True, text=True, timeout=TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A running cluster: its directory (data, socket, log) and its port. The superuser is `postgres`."""

    def __init__(self, root: Path, port: int, pg_ctl: str) -> None:
        self.root = root
        self.port = port
        self._pg_ctl = pg_ctl
        self._stopped = False
        self._admin = None  # one connection for CREATE DATABASE: each connection is a new server process
        self._admin_lock = threading.Lock()
        self._to_drop: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._dropper: threading.Thread | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str, template: str | None = None) -> str:
        """A new database (a copy of `template` when named, which then must have no other connection); its URL."""
        from psycopg import sql

        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        self._admin_execute(statement, copy=template is not None)
        return self.url(name)

    def drop_database_later(self, name: str) -> None:
        """Drop a database soon, on a thread and connection of its own, ending any connection still on it (a
        killed server's, say): the test that used it does not wait for the drop."""
        with self._admin_lock:
            if self._dropper is None:
                self._dropper = threading.Thread(target=self._drop_queued, name="pg-cluster-dropper", daemon=True)
                self._dropper.start()
        self._to_drop.put(name)

    def _drop_queued(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            while (name := self._to_drop.get()) is not None:
                try:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
                except psycopg.DatabaseError:
                    pass  # a database left behind costs only room, until the cluster is thrown away

    def _admin_execute(self, statement, copy: bool = False) -> None:
        import psycopg
        from psycopg import sql

        with self._admin_lock:
            if self._admin is None or self._admin.closed:
                self._admin = psycopg.connect(self.url("postgres"), autocommit=True)
            if copy and self._admin.info.server_version >= 150000:
                # Postgres 15's default copies a template page by page through the WAL; a file copy costs less
                statement += sql.SQL(" STRATEGY FILE_COPY")
            self._admin.execute(statement)

    def stop(self) -> None:
        """Stop the server and remove the cluster's directory. Idempotent. Immediate: nothing here is kept, and the
        shutdown checkpoint of a fast stop wrote out the hundreds of databases a test run makes. The directory (a
        few hundred thousand files after a run) is removed by an `rm` of its own that this process does not wait
        for: removing it here held the run's end for half a minute."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        if self._dropper is not None:
            self._to_drop.put(None)
            self._dropper.join(TIMEOUT_S)
        if self._admin is not None:
            self._admin.close()
        _run(self._pg_ctl, "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", str(TIMEOUT_S))
        subprocess.Popen(("rm", "-rf", "--one-file-system", str(self.root)), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(in_memory: bool = False) -> Cluster:
    """initdb and start a new cluster (in memory when asked and there is room). Raises RuntimeError (with the
    server's log) if it does not come up."""
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    binaries = _binaries()
    # Not under pytest's tmp_path: that is private to the user running the tests, and the server runs as postgres.
    root = Path(tempfile.mkdtemp(prefix="switchboard-pg-", dir=_in_memory_directory() if in_memory else None))
    if _as_root():
        shutil.chown(root, "postgres", "postgres")
    try:
        # C collation and UTF-8: text sorts by bytes, as SQLite's BINARY collation does.
        made = _run(binaries["initdb"], "-D", str(root / "data"), "-U", "postgres", "--auth=trust",
                    "--encoding=UTF8", "--locale=C", "--no-sync")
        if made.returncode != 0:
            raise RuntimeError(f"initdb failed: {made.stdout}{made.stderr}")
        settings = {**SETTINGS, "unix_socket_directories": f"'{root}'"}
        with open(root / "data" / "postgresql.conf", "a") as conf:
            conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
        for _ in range(START_ATTEMPTS):
            port = _free_port()
            started = _run(binaries["pg_ctl"], "start", "-D", str(root / "data"), "-l", str(root / "server.log"),
                           "-w", "-t", str(TIMEOUT_S), "-o", f"-p {port}")
            if started.returncode == 0:
                cluster = Cluster(root, port, binaries["pg_ctl"])
                atexit.register(cluster.stop)
                _wait_for_tcp(port)
                return cluster
            time.sleep(0.2)
        log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
        raise RuntimeError(f"pg_ctl start failed: {started.stdout}{started.stderr}\n{log[-4000:]}")
    except BaseException:
        with contextlib.suppress(Exception):
            _run(binaries["pg_ctl"], "stop", "-D", str(root / "data"), "-m", "immediate", "-w")
        shutil.rmtree(root, ignore_errors=True)
        raise


def _wait_for_tcp(port: int) -> None:
    """pg_ctl -w waits on the socket file; a test connects over TCP, so make sure the server accepts there too."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
