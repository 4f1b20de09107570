"""Rule evaluation benchmark (SPEC section 13): the fleet pack on a ~15 KB GitHub issue payload, including the
round trip to the sandboxed evaluator child, measured in-process.

    python tests/bench/bench_rules.py [--quick]      (normally run through tests/bench/run_all.py)

`switchboard.decide(ev, rules, default, params, "hold", doc)` is what ingress runs per delivery (on a worker
thread), with `doc = json.dumps(envelope).encode()` built by `switchboard.build_envelope` from an `issues.labeled`
delivery whose issue body is padded so the raw payload is ~15 KB and whose only label is `size/S`, so the first
match is rule 10 of 22 (`issue-size-s`): every earlier rule is evaluated and fails first.

For context two more series run on the same document: a one-rule set `false` (the pipe round trip, the child's
JSON parse of the envelope and its reply, with almost no jq work) and the combined fleet program run in this
process with the `jq` module (jq work alone, no pipe and no sandbox).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import producers  # noqa: E402
from bench_ingest import PARAMS, labeled_delivery  # noqa: E402
from bench_store import ROOT, percentile  # noqa: E402

from switchboard.envelope import build_envelope  # noqa: E402 - on the path bench_store put it on
from switchboard.evaluator import Evaluator, combined_program  # noqa: E402
from switchboard.store.routing import decide  # noqa: E402

TARGET_BYTES = 15 * 1024


def build_doc() -> tuple[bytes, bytes]:
    """The raw ~15 KB payload (issue body padded) and the envelope document the evaluator is sent."""
    base = json.loads(labeled_delivery("x", 4242, "S")[0])
    body_text = base["issue"].get("body") or ""
    filler = "Steps to reproduce: open the README, read the second paragraph, notice the typo. " * 400
    # Pad, then trim to land on the target (the JSON encoding of the filler is 1 byte per char).
    base["issue"]["body"] = body_text
    raw = json.dumps(base).encode()
    base["issue"]["body"] = body_text + filler[:max(0, TARGET_BYTES - len(raw))]
    raw = json.dumps(base).encode()
    headers = {"x-github-event": "issues", "x-github-delivery": str(uuid.uuid4()), "content-type": "application/json",
               "x-hub-signature-256": "sha256=" + producers.hex_hmac("secret", raw),
               "user-agent": "GitHub-Hookshot/bench"}
    # The webhook trusts the fixture's sender, as bench_ingest's topology does.
    envelope = build_envelope(provider="github", webhook_id="wh_x", trust_mode="signed", verified=True,
                              headers=headers, body=raw, payload=json.loads(raw),
                              trusted_actors={"logins": ["Codertocat"], "match": "sender"})
    return raw, json.dumps(envelope).encode()


def _series(fn, n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _summary(lat: list[float]) -> dict:
    return {"runs": len(lat), "mean_ms": statistics.fmean(lat), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "max_ms": max(lat)}


def bench_rules(n: int, warmup: int = 200) -> dict:
    pack = json.loads((ROOT / "packs" / "fleet.json").read_text())
    rules, default = pack["rules"], pack.get("default_action")
    raw, doc = build_doc()
    ev = Evaluator()
    try:
        action, trace = decide(ev, rules, default, PARAMS, "hold", doc)
        if trace.get("rule_id") != "issue-size-s" or action.get("queue") != "lane-s":
            raise RuntimeError(f"the fleet pack did not route the padded delivery to lane-s: {trace}")
        fleet = _series(lambda: decide(ev, rules, default, PARAMS, "hold", doc), n, warmup)
        trivial_rules = [{"id": "never", "expr": "false", "action": {"drop": True}}]
        trivial = _series(lambda: decide(ev, trivial_rules, default, PARAMS, "hold", doc), n, warmup)
    finally:
        ev.close()
    inproc = None
    try:
        import jq  # the module the sandbox child uses

        program = jq.compile(combined_program(tuple(r["expr"] for r in rules)), args={"params": PARAMS})
        first = program.input_text(doc.decode()).first()
        inproc = _summary(_series(lambda: program.input_text(doc.decode()).first(), n, warmup))
        inproc["first_output"] = first
    except Exception as exc:  # noqa: BLE001 - the context series is optional; say why it is missing
        inproc = {"error": f"{type(exc).__name__}: {exc}"}
    return {"payload_bytes": len(raw), "envelope_bytes": len(doc), "rules": len(rules), "matched": trace["rule_id"],
            "matched_index": trace["rule_index"], "warmup": warmup,
            "fleet": _summary(fleet), "trivial_one_rule": _summary(trivial), "jq_in_process": inproc}


if __name__ == "__main__":
    print(json.dumps(bench_rules(300 if "--quick" in sys.argv else 2000), indent=2))
