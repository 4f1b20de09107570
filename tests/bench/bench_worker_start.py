"""What one `--exec` job start costs the worker itself (issue 35: measure before adding a preexec_fn).

    python tests/bench/bench_worker_start.py [--quick]

In this process, the worker's own ExecRunner runs `true` once per job, one job at a time, as the worker does it:
a private directory made and removed, the child spawned with its environment and session, the todo written to
its stdin, its exit awaited, and every process of the job looked for and ended. No server: this is the worker's
share of a job, which issue 39's end-to-end benchmark adds the round trips to. Three ways of spawning:

- `runner`: the ExecRunner as shipped (subprocess's vfork fast path; the job watcher told of each child);
- `runner --exec-user nobody` (as root only): the child takes another user, which makes subprocess fork;
- `preexec_fn`: the shipped runner with a preexec_fn that sets the parent-death signal in each child, the
  alternative the job watcher replaced, which makes subprocess fork and run Python in the child.

Reports the median and p90 wall time per job start in ms (after a warm-up), the worker's own CPU per job (which
load on a shared machine moves least), and the machine's load average.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from switchboard.worker.exec_runner import ExecRunner  # noqa: E402
from switchboard.worker.job import Job  # noqa: E402

WARMUP = 20


class PreexecRunner(ExecRunner):
    """The shipped runner, spawning with a preexec_fn that sets the parent-death signal: for comparison only."""

    def spawn(self, job, workdir, outcome_file, **options):
        libc = ctypes.CDLL(None, use_errno=True)
        return super().spawn(job, workdir, outcome_file, preexec_fn=lambda: libc.prctl(1, signal.SIGKILL, 0, 0, 0),
                             **options)


async def starts(runner: ExecRunner, jobs: int) -> tuple[list[float], float]:
    """Wall time of each job (ms) and the worker's own CPU over them all (seconds, every thread of this process:
    the figure load on a shared machine moves least)."""
    took, cpu = [], 0.0
    for n in range(WARMUP + jobs):
        job = Job({"id": f"td_bench{n}", "queue": "bench", "attempt": 1, "payload": None}, "bench")
        started, started_cpu = time.perf_counter(), time.process_time()
        outcome = await runner.run(job)
        if outcome.outcome != "complete":
            raise RuntimeError(f"the job did not complete: {outcome}")
        if n >= WARMUP:
            took.append((time.perf_counter() - started) * 1e3)
            cpu += time.process_time() - started_cpu
    return took, cpu


def summary(took: list[float], cpu: float) -> dict:
    took = sorted(took)
    return {"jobs": len(took), "p50_ms": round(statistics.median(took), 2),
            "p90_ms": round(took[int(len(took) * 0.9)], 2), "worker_cpu_ms_per_job": round(cpu / len(took) * 1e3, 2)}


def main(jobs: int) -> dict:
    kinds = {"runner": lambda: ExecRunner(["true"]), "preexec_fn": lambda: PreexecRunner(["true"])}
    if os.geteuid() == 0:
        kinds["runner --exec-user nobody"] = lambda: ExecRunner(["true"], "nobody")
    results: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name in kinds}
    for _ in range(3):  # interleaved rounds, so that a burst of load falls on all of them
        for name, make in kinds.items():
            took, cpu = asyncio.run(starts(make(), jobs // 3))
            results[name] = (results[name][0] + took, results[name][1] + cpu)
    return {"load_average": os.getloadavg(), **{name: summary(*result) for name, result in results.items()}}


if __name__ == "__main__":
    print(json.dumps(main(150 if "--quick" in sys.argv else 600), indent=2))
