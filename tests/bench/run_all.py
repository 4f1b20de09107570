"""Every benchmark of SPEC section 13 in one run, then docs/speed.md's region rewritten with the results.

    python tests/bench/run_all.py [--quick] [--no-page]

1. compare    Switchboard side by side with a minimal Starlette + uvicorn app (the architecture's ceiling) and
              the peer SQLite queues: ingest without rules and with the fleet pack (16 senders, p99 ack),
              claim+complete over REST (8 workers), in-process claim+ack vs litequeue / persist-queue / huey,
              idle CPU, database size and RSS after 10,000 deliveries, each against its goal (bench_compare.py)
2. doorbell   202 -> notification latency for SSE, MCP and a waiting claim, 50 sessions (bench_doorbell.py)
3. rules      fleet-pack evaluation per delivery on a 15 KB payload, sandbox round trip included (bench_rules.py)

bench_compare supersedes this script's former ingest (FULL/NORMAL), REST claim+complete and in-process steps;
bench_ingest.py and bench_store.py still run them on their own (NORMAL included). The whole run stays under
5 minutes on the 2-core development machine.

Writes tests/bench/results-all.json (git-ignored) and replaces only the lines between `<!-- bench:start -->`
and `<!-- bench:end -->` in docs/speed.md, the comparison table first. Exit status 1 when any benchmark failed or
failed its own checks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_compare  # noqa: E402
import bench_doorbell  # noqa: E402
import bench_rules  # noqa: E402
import bench_store  # noqa: E402

ROOT = bench_store.ROOT
SPEED_PAGE = ROOT / "docs" / "speed.md"  # where every benchmark's figures are kept, between its markers
RESULTS_PATH = HERE / "results-all.json"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"

SIZES = {  # full, quick (bench_compare has its own, see bench_compare.SIZES_FULL / SIZES_QUICK)
    "doorbell_rings": (200, 40),
    "rules_runs": (2000, 300),
}


# ----------------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------------

def size(name: str, quick: bool) -> int:
    full, small = SIZES[name]
    return small if quick else full


def run_step(results: dict, name: str, fn, *args):
    print(f"[{time.strftime('%H:%M:%S')}] {name}...", file=sys.stderr, flush=True)
    cpu0 = cpu_snapshot()
    try:
        out = fn(*args)
    except Exception:  # noqa: BLE001 - record it, run the rest, fail the run at the end
        out = {"error": traceback.format_exc(limit=8)}
        print(out["error"], file=sys.stderr)
    load = other_load(cpu0, cpu_snapshot())
    results["steps"][name] = {"seconds": load["wall_s"], "other_cores": load["other_cores"],
                              "steal_cores": load["steal_cores"]}
    return out


def cpu_snapshot() -> tuple[float, float, float, float]:
    """(wall, busy CPU seconds of the whole machine, CPU seconds of this process and its reaped children,
    steal: CPU seconds the hypervisor gave to someone else)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = (sum(fields[:3]) + sum(fields[5:7])) / tick  # user nice system irq softirq (guest is inside user)
    steal = (fields[7] if len(fields) > 7 else 0) / tick
    own = os.times()
    return time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system, steal


def other_load(before: tuple, after: tuple) -> dict:
    """CPU used by processes that are not this run (its servers and evaluator children are waited for, so
    they count as ours), and steal time: a busy machine makes every number here worse, so the report says
    how busy it was."""
    wall = after[0] - before[0]
    others = max(0.0, (after[1] - before[1]) - (after[2] - before[2]))
    return {"wall_s": round(wall, 1), "other_cpu_s": round(others, 1), "other_cores": round(others / wall, 2),
            "steal_cores": round((after[3] - before[3]) / wall, 2)}


def wait_until_quiet(max_seconds: float, threshold: float = 0.25, window: float = 3.0) -> dict:
    """Wait (up to max_seconds) until other processes use under `threshold` cores over a `window`."""
    t0 = time.monotonic()
    while True:
        before = cpu_snapshot()
        time.sleep(window)
        load = other_load(before, cpu_snapshot())["other_cores"]
        waited = time.monotonic() - t0
        if load < threshold or waited >= max_seconds:
            return {"waited_s": round(waited, 1), "other_cores_at_start": load, "quiet": load < threshold}
        print(f"[{time.strftime('%H:%M:%S')}] waiting for a quiet machine: other processes use {load:.2f} cores",
              file=sys.stderr, flush=True)


def run_all(quick: bool) -> dict:
    results: dict = {"machine": bench_store.machine_facts(), "quick": quick, "sizes": {k: size(k, quick) for k in SIZES},
                     "steps": {}, "loadavg_at_start": os.getloadavg()}
    t0 = time.perf_counter()
    cpu0 = cpu_snapshot()
    results["compare"] = run_step(results, "compare", bench_compare.run, quick)
    results["doorbell"] = run_step(results, "doorbell", bench_doorbell.bench_doorbell, size("doorbell_rings", quick))
    results["rules"] = run_step(results, "rules", bench_rules.bench_rules, size("rules_runs", quick))
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    results["other_processes"] = other_load(cpu0, cpu_snapshot())
    if bench_store.source_fingerprint() != results["machine"]["source"]:
        results["warning"] = "the package changed on disk during the run"
    results["failures"] = failures(results)
    return results


def last_line(error: str) -> str:
    """The exception line of a formatted traceback (inside an exception group's box drawing, too)."""
    lines = [line.strip().lstrip("|").strip() for line in error.strip().splitlines()]
    lines = [line for line in lines if line and set(line) - set("+-")]
    return lines[-1] if lines else error.strip()


def failures(results: dict) -> list[str]:
    bad = []
    compare = results["compare"]
    if "error" in compare:
        bad.append(f"compare: {last_line(compare['error'])}")
    else:
        bad += [f"compare: {x}" for x in compare["failures"]]
    for key in ("doorbell", "rules"):
        item = results[key]
        if "error" in item:
            bad.append(f"{key}: {last_line(item['error'])}")
    if "channels" in results["doorbell"]:
        for ch in results["doorbell"]["channels"]:
            if not ch["verified"]["ok"]:
                bad.append(f"doorbell {ch['channel']}: checks failed: {json.dumps(ch['verified'])[:600]}")
    return bad


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------

def f(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    return f"{x:,.{digits}f}"


def table(results: dict) -> list[str]:
    rows = ["| # | benchmark | setting | result | p50 | p99 | notes |", "|---|---|---|---:|---:|---:|---|"]
    failed = "FAILED (see results-all.json)"

    door = results["doorbell"]
    labels = {"sse": "SSE `GET /api/v1/doorbell`", "mcp": "MCP `notifications/claude/channel`",
              "wait": "waiting claim (`wait_seconds: 30`)"}
    if "error" in door:
        rows.append(f"| 1 | doorbell | | {failed} | | | |")
    else:
        for ch in door["channels"]:
            early = round(ch["share_before_202"] * ch["rings"])
            extra = "; ".join(x for x in (
                f"notification parsed before the 202 for {early} of {ch['rings']}" if early else "",
                "includes the claim's own commit" if ch["channel"] == "wait" else "") if x)
            rows.append(f"| 1 | doorbell, 202 → notification: {labels[ch['channel']]} | "
                        f"{door['synchronous']}, {ch['sessions']} sessions | {ch['rings']} rings | "
                        f"{f(ch['p50_ms'], 2)} ms | {f(ch['p99_ms'], 2)} ms | "
                        f"POST start → notification p50/p99 {f(ch['from_post_p50_ms'], 1)}/"
                        f"{f(ch['from_post_p99_ms'], 1)} ms; {extra}{'; ' if extra else ''}"
                        f"{ch['sessions_rung']} sessions rung, each todo exactly once: "
                        f"{'yes' if ch['verified']['ok'] else 'NO'} |")

    rules = results["rules"]
    if "error" in rules:
        rows.append(f"| 2 | rule evaluation | | {failed} | | | |")
    else:
        fl, tr, jq = rules["fleet"], rules["trivial_one_rule"], rules["jq_in_process"]
        jq_note = f"; jq alone in-process p50 {f(jq['p50_ms'], 2)} ms" if "p50_ms" in jq else ""
        rows.append(f"| 2 | rule evaluation per delivery, fleet pack ({rules['rules']} rules), sandbox round trip | "
                    f"{rules['payload_bytes'] / 1024:.0f} KB payload | **mean {f(fl['mean_ms'], 2)} ms** | "
                    f"{f(fl['p50_ms'], 2)} ms | {f(fl['p99_ms'], 2)} ms | target < 2 ms: mean "
                    f"{'met' if fl['mean_ms'] < 2 else 'NOT met'}, p99 {'met' if fl['p99_ms'] < 2 else 'NOT met'}; "
                    f"{fl['runs']} runs; first match rule "
                    f"{rules['matched_index'] + 1} `{rules['matched']}`; one-rule `false` round trip p50 "
                    f"{f(tr['p50_ms'], 2)} ms{jq_note} |")

    return rows


HOW_MEASURED = (
    "**How measured (doorbell, rules).** Client and server share the machine's cores over loopback. The doorbell "
    "benchmark starts a real `python switchboard.py serve` child on a fresh SQLite file, set up through the CLI, "
    "and stops it by its pid. "
    "(1) Doorbell: each channel has its own endpoint owning a GitHub webhook with no rules (plain fan-out) and 50 "
    "sessions of that channel connected on the measured endpoint itself; the doorbell rings exactly one of them per "
    "todo, so the time is taken on whichever session was rung (the run checks each todo rang once). Deliveries are "
    "sent one at a time, the next after the previous notification; latency is from the 202 being parsed to the "
    "notification being parsed, in the same process. The server rings right after COMMIT, before it writes the "
    "202, so a notification can be parsed before the 202; such latencies count as negative (the notes say how "
    "many). The waiting-claim latency ends at the "
    "claim's 200 and includes that claim's own commit; after each ring the sender waits 50 ms so the woken worker "
    "is waiting again. "
    "(2) Rules: in-process `switchboard.decide` through a real `Evaluator` (sandboxed child, pipe round trip, "
    "JSON parse of the envelope in the child), after a warm-up. "
    "`--wait-quiet SECONDS` first waits for other processes to leave the CPUs idle; the machine line says how "
    "much CPU other processes took during the run anyway.")


def markdown(results: dict) -> str:
    m = results["machine"]
    src = m["source"]
    compare = results["compare"]
    if "error" in compare:
        compare_block = ["Comparison (bench_compare.py): FAILED (see results-all.json)."]
    else:
        compare_block = [bench_compare.markdown(compare, header=False)]
    lines = [
        f"Measured {m['date'].replace('+00:00', '').replace('T', ' ')} UTC"
        f"{' (QUICK RUN: small sizes, not representative)' if results['quick'] else ''}, "
        f"switchboard {m['switchboard']} at `{src['git_head']}`{' + uncommitted changes' if src['dirty'] else ''} "
        f"(source hash {src['sha256_package']}); whole run {results['elapsed_s']:.0f} s.",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model'] or 'model unknown'}), {m['memory']} memory, "
        f"Python {m['python']}, SQLite {m['sqlite']}, {m['os']}. Load average (1/5/15 min) at the start "
        f"{'/'.join(f'{x:.2f}' for x in results['loadavg_at_start'])}. Other processes used "
        f"{results['other_processes']['other_cores']:.2f} cores on average during the run (at most "
        f"{max(v['other_cores'] for v in results['steps'].values()):.2f} during one benchmark); hypervisor steal "
        f"{results['other_processes']['steal_cores']:.2f} cores.",
        "",
        "**Side by side** (`python tests/bench/bench_compare.py`; Switchboard against the minimal app that is this "
        "architecture's ceiling here, and against the peer SQLite queues):",
        "",
        *compare_block,
        "",
        "**Other benchmarks in this run:**",
        "",
        *table(results),
        "",
        HOW_MEASURED,
    ]
    return "\n".join(lines + bench_store.report_notes(results))


def rewrite_page(block: str, path: Path = SPEED_PAGE, start: str = START, end: str = END) -> None:
    """Replace what lies strictly between the marker lines, and nothing else."""
    text = path.read_text()
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == start]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or starts[0] >= ends[0]:
        raise RuntimeError(f"{path.name} must hold exactly one {start} line before exactly one {end} line")
    new = lines[:starts[0] + 1] + block.split("\n") + lines[ends[0]:]
    path.write_text("\n".join(new))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the harness works")
    parser.add_argument("--no-page", action="store_true", help="leave docs/speed.md alone")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="first wait up to SECONDS for other processes to leave the CPUs idle")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    quiet = wait_until_quiet(args.wait_quiet) if args.wait_quiet > 0 else None
    results = run_all(args.quick)
    results["wait_quiet"] = quiet
    return report(results, markdown(results), args.out, not args.no_page)


def report(results: dict, block: str, out: str, page: bool, start: str = START, end: str = END) -> int:
    """Save the results, print the Markdown block (and put it in docs/speed.md between its markers), name the
    failures; the exit status: 1 when there were any."""
    Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print(block)
    if page:
        rewrite_page(block, start=start, end=end)
    print(f"\n(wrote {out}{' and docs/speed.md' if page else ''}; {results['elapsed_s']:.0f} s)", file=sys.stderr)
    for problem in results["failures"]:
        print(f"FAILURE: {problem}", file=sys.stderr)
    if results.get("warning"):
        print(f"WARNING: {results['warning']}", file=sys.stderr)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
