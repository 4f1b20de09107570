"""The reference implementation's published pack fixture cases, run through OUR packs on the real evaluator.

`tests/data/reference_cases/` holds, as test data, the fixture cases the reference implementation of this design
publishes for its fleet and pool-review packs (see that directory's README for the repository, paths and
commits). Every case is routed through our `packs/fleet.json` / `packs/pool-review.json`:

- through the dry run (`POST /api/v1/webhooks/{id}/rules/test`, the sandboxed child), always; and
- as a real delivery to the ingest URL where the case describes one a producer can send: a verified case on a
  signed source is signed as that producer signs it, a pool case (an unsigned, token-trust generic hook) is
  posted as is. Each case gets its own database, so once keys and dedup never couple cases.

The decision is compared decision for decision: queue or drop (or hold), the deciding rule's intent (the
reference's rule ids map to ours below), the exclusive target, the once key (from the reference's subject key),
and the work order. `projections.json` carries what the reference's unit tests assert about subjects, work
orders and envelope paths on the same samples; those are checked against our envelope and work orders.

Cases where our packs deliberately decide otherwise, because our own contract says so, are strict xfails with
the reason (`DIVERGENCES`); everything else must match.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import producers
import pytest
from test_packs import AUTHORITY, LANE_QUEUES, check_dry_run, deploy, load

DATA = Path(__file__).resolve().parent / "data" / "reference_cases"
REDACTED = "«redacted»"


def data(name: str) -> dict:
    return json.loads((DATA / name).read_text())


FLEET = data("fleet.json")
POOL = data("pool-review.json")
PROJECTIONS = data("projections.json")

# The reference's params are spelled as ours: every name it uses means the same thing here. `bot_actors` (pool)
# is read by our bot-noise rule; a reference pool case with identity "" stands for a webhook with no params.
PARAM_NAMES = {"require_verified": "require_verified", "trusted_humans": "trusted_humans",
               "trusted_agents": "trusted_agents", "cairn_actors": "cairn_actors", "repo_prefixes": "repo_prefixes",
               "identity": "identity", "bot_actors": "bot_actors"}

# Reference rule id -> the ids of our rules with the same intent. Where ours is coarser (one rule for the
# author, labeler and repository allowlists) several reference rules map to one of ours; where ours is finer
# (pull requests apart from other non-issues) one maps to several.
FLEET_INTENTS = {
    "unverified": {"unverified"},
    "cairn-not-handoff": {"handoff-untagged"},
    "cairn-untrusted-actor": {"handoff-untrusted"},
    "cairn-ambiguous": {"handoff-ambiguous"},
    "cairn-size-xl": {"handoff-xl"},
    "cairn-lane-s": {"handoff-s"}, "cairn-size-s": {"handoff-s"},
    "cairn-lane-m": {"handoff-m"}, "cairn-size-m": {"handoff-m"},
    "cairn-lane-l": {"handoff-l"}, "cairn-size-l": {"handoff-l"},
    "cairn-lane-vision": {"handoff-vision"},
    "cairn-triage": {"handoff-triage"},
    "not-an-issue": {"pull-request", "not-work"},
    "repo-not-allowlisted": {"issue-untrusted"},
    "bot-issue": {"issue-bot", "bot"},
    "untrusted-author": {"issue-untrusted"},
    "untrusted-labeler": {"issue-untrusted"},
    "not-open": {"issue-closed"},
    "not-routable-action": {"issue-other-action"},
    "human-verdict": {"issue-hold"}, "size-xl": {"issue-hold"}, "ambiguous-size": {"issue-hold"},
    "size-s": {"issue-size-s"}, "size-m": {"issue-size-m"}, "size-l": {"issue-size-l"},
    "unsized-new-issue": {"issue-triage"},
}
POOL_INTENTS = {
    "review-request-not-for-me": {"review-request-other"},
    "own-pr-review-trigger": {"own-pr-trigger"},
    "bot-comment-noise": {"bot-noise"},
    "bot-review-outcome": {"bot-noise"},
    "review-outcome-not-my-pr": set(),  # no such rule: see DIVERGENCES
}

# Where our contract (the product spec's pack section, pinned by tests/test_packs.py) decides otherwise.
_NO_IDENTITY_QUARANTINES = (
    "our pack fails a review request with no identity closed by holding it in quarantine (rule "
    "review-request-no-identity, releasable once the identity is set); the reference drops it")
_OUTCOMES_REACH_THE_POOL = (
    "our contract drops only review requests for someone else, review triggers on the identity's own pull "
    "requests and bot noise, and sends everything else to the pool's queue; the reference also drops review "
    "outcomes (pull_request_approved/_rejected) on pull requests the identity did not author, and all of them "
    "when no identity is set (its rule review-outcome-not-my-pr)")
DIVERGENCES = {
    "with no identity set, every review request fails closed": _NO_IDENTITY_QUARANTINES,
    "with no identity set, a team request (no requested_reviewer) fails closed too": _NO_IDENTITY_QUARANTINES,
    "with no params at all, a bot approval still fails closed": _OUTCOMES_REACH_THE_POOL,
    "the reviewer's echo of its own approval is dropped": _OUTCOMES_REACH_THE_POOL,
    "with no identity set, review outcomes fail closed": _OUTCOMES_REACH_THE_POOL,
}

FLEET_DEPLOYMENT = {"pack": "fleet.json", "params": {PARAM_NAMES[k]: v for k, v in FLEET["params"].items()},
                    "topology": {"owner_queues": ["hold"], "webhook_queue": "hold",
                                 "lane_endpoints": ["lane-s", "lane-m", "lane-l", "lane-vision", "triage"]}}
POOL_TOPOLOGY = {"owner_queues": ["forge"], "lane_endpoints": [], "webhook_queue": "forge"}


def sample(name: str) -> dict:
    return data(f"samples/{name}.json")


def case_body(case: dict) -> tuple[str, dict, dict]:
    """The case's source, body (the sample deep-merged with the patch: objects merge, anything else replaces) and
    headers (as the reference recorded them)."""
    smp = sample(case["sample"])
    body = producers.deep_merge(smp["body"], case["patch"]) if case.get("patch") else smp["body"]
    return case.get("source", smp["source"]), body, dict(smp["headers"])


def pool_params(case: dict) -> dict:
    if case["identity"] == "":
        return {}
    return {**{PARAM_NAMES[k]: v for k, v in POOL["params"].items()}, PARAM_NAMES["identity"]: case["identity"]}


def reference_once_key(subject_key: str, queue: str) -> str:
    return "once:" + hashlib.sha256(subject_key.encode() + b"\x00" + queue.encode()).hexdigest()


def divergent(cases: list[dict]) -> list:
    return [pytest.param(c, id=c["name"], marks=pytest.mark.xfail(reason=DIVERGENCES[c["name"]], strict=True))
            if c["name"] in DIVERGENCES else pytest.param(c, id=c["name"]) for c in cases]


def router_hook(dep, source: str, deployment: dict) -> dict:
    """The webhook a case arrives on. The reference's pack harness evaluates with no trust-gate verdict, so where
    a webhook has a trust list (github, gitea, cairn) it trusts every actor, and the pack alone decides, as there."""
    hook = dep.hook(source, deployment)
    if source in ("github", "gitea", "cairn"):
        r = dep.client.put(f"/api/v1/webhooks/{hook['id']}/trusted-actors", headers=dep.human.auth,
                           json={"allow_all": True})
        assert r.status_code == 200, r.text
    return hook


# -- one decision, from the dry run or from a delivery ----------------------------------------------

def dry_run(dep, hook: dict, body, headers: dict, verified: bool, params: dict | None = None,
            rules: list | None = None) -> dict:
    request = {"payload": body, "headers": headers, "verified": verified}
    if params is not None:
        request["params"] = params
    if rules is not None:
        request["rules"] = rules
    r = dep.client.post(f"/api/v1/webhooks/{hook['id']}/rules/test", headers=dep.human.auth, json=request)
    assert r.status_code == 200, r.text
    return r.json()


def dry_run_view(result: dict) -> dict:
    decision, trace = result["decision"], result["trace"]
    return {"disposition": decision["disposition"], "queue": decision["queue"], "endpoints": decision["endpoints"],
            "stage": trace["stage"], "rule_id": trace.get("rule_id"), "hold": trace.get("hold"),
            "fault": decision["fault"], "once_key": result["once_key"], "work_order": result["work_order"],
            "subject_key": result["envelope"].get("subject_key")}


def delivered_view(dep, outcome: dict) -> dict:
    r = dep.client.get(f"/api/v1/events/{outcome['event_id']}", headers=dep.human.auth)
    assert r.status_code == 200, r.text
    event = r.json()
    trace, todos = event["trace"], outcome["todos"]
    order = dep.todo(todos[0]["id"])["work_order"] if len(todos) == 1 else None
    return {"disposition": outcome["disposition"], "queue": todos[0]["queue"] if todos else None,
            "endpoints": [t["endpoint_id"] for t in todos], "stage": trace["stage"], "rule_id": trace.get("rule_id"),
            "hold": trace.get("hold"), "fault": trace.get("faults"), "once_key": trace.get("once_key"),
            "work_order": order, "subject_key": event["envelope"].get("subject_key")}


def check_decision(dep, expect: dict, intents: dict, view: dict, verified: bool, source: str) -> list[str]:
    """The reference's expectation against one of our decisions."""
    problems = []
    if view["fault"]:
        problems.append(f"faulted: {view['fault']}")
    rule = f"rule {view['rule_id']} ({view['stage']})"
    if expect["decision"] == "drop":
        if view["disposition"] != "dropped" or view["endpoints"]:
            problems.append(f"{view['disposition']} to {view['queue']} by {rule}, expected a drop")
    else:
        queue = expect["queue"]
        if view["disposition"] != "routed" or view["queue"] != queue:
            problems.append(f"{view['disposition']} to {view['queue']} by {rule} (hold: {view['hold']}), "
                            f"expected queue {queue}")
        elif view["endpoints"] != [dep.endpoint_for(queue)]:
            problems.append(f"endpoints {view['endpoints']}, expected exactly [{dep.endpoint_for(queue)}]")
    if "rule" in expect:
        if expect["rule"] is None:
            if view["stage"] != "default":
                problems.append(f"decided by {rule}, expected no rule (the pool's queue)")
        elif view["rule_id"] not in intents[expect["rule"]]:
            problems.append(f"decided by {rule}, expected the intent of {expect['rule']} "
                            f"(ours: {sorted(intents[expect['rule']]) or 'none'})")
    if expect.get("once"):
        want = reference_once_key(expect["subject_key"], expect["queue"])
        if view["subject_key"] != expect["subject_key"]:
            problems.append(f"subject key {view['subject_key']}, expected {expect['subject_key']}")
        if view["once_key"] != want:
            problems.append(f"once key {view['once_key']}, expected {want}")
    order = view["work_order"]
    if expect.get("work_order"):
        if not order:
            problems.append("no work order")
        else:
            wanted = {"version": 1, "lane": expect["queue"], "source": source, "verified": verified}
            got = {k: order.get(k) for k in wanted}
            if got != wanted:
                problems.append(f"work order {got}, expected {wanted}")
            if order.get("authority") != AUTHORITY:
                problems.append("work order authority is not the fixed text")
            if "rule" in expect and order["authorized_by"].get("rule_id") not in intents[expect["rule"]]:
                problems.append(f"work order authorized by {order['authorized_by']}")
            if expect["queue"] not in LANE_QUEUES:
                problems.append("a work order outside the lanes")
    elif expect["decision"] == "queue" and order is not None:
        problems.append(f"a work order on {expect['queue']}: {order}")
    return problems


# -- producing real deliveries ----------------------------------------------------------------------

def signed_delivery(source: str, secret: str, body: dict, headers: dict, clock) -> tuple[bytes, dict]:
    """Sign the case's body the way its producer does. The reference's recorded signature headers are
    placeholders; cairn's signed created_at must be fresh, so it is moved to now (routing never reads it)."""
    headers = {k: v for k, v in headers.items() if v != REDACTED}
    if source == "cairn":
        body = {**body, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(clock.now_ms() // 1000))}
    raw = json.dumps(body).encode()
    mac = producers.hex_hmac(secret, raw)
    if source == "github":
        headers["X-Hub-Signature-256"] = "sha256=" + mac
    elif source == "gitea":
        headers["X-Gitea-Signature"] = mac
    else:
        headers["X-Cairn-Signature"] = "sha256=" + mac
    return raw, headers


# -- the fleet cases --------------------------------------------------------------------------------

def test_transcription_is_complete():
    assert len(FLEET["cases"]) == 39 and len(POOL["cases"]) == 26
    names = [c["name"] for c in FLEET["cases"] + POOL["cases"]]
    assert len(set(names)) == len(names)
    for case in FLEET["cases"] + POOL["cases"]:
        assert (DATA / "samples" / f"{case['sample']}.json").exists(), case["sample"]
        rule = case["expect"].get("rule")
        assert rule is None or rule in (FLEET_INTENTS if case in FLEET["cases"] else POOL_INTENTS), rule
    assert set(DIVERGENCES) <= set(names)
    assert set().union(*FLEET_INTENTS.values()) <= {r["id"] for r in load("fleet.json")["rules"]}
    assert set().union(*POOL_INTENTS.values()) <= {r["id"] for r in load("pool-review.json")["rules"]}


@pytest.mark.parametrize("case", divergent(FLEET["cases"]))
def test_fleet_case(world, clock, case):
    dep = deploy(world, FLEET_DEPLOYMENT)
    source, body, headers = case_body(case)
    hook = router_hook(dep, source, FLEET_DEPLOYMENT)
    result = dry_run(dep, hook, body, headers, case["verified"])
    expect = case["expect"]
    shared = {"expect": {"disposition": "dropped"} if expect["decision"] == "drop"
              else {"disposition": "routed", "queue": expect["queue"]}}
    problems = [f"dry run: {p}" for p in check_dry_run(dep, shared, result)]
    problems += [f"dry run: {p}" for p in
                 check_decision(dep, expect, FLEET_INTENTS, dry_run_view(result), case["verified"], source)]
    # A delivery a producer can actually send: verified, on a signed source.
    if case["verified"] and source in ("github", "gitea", "cairn"):
        raw, sent = signed_delivery(source, hook["secret"], body, headers, clock)
        outcome = dep.deliver(hook, raw, sent)
        problems += [f"delivered: {p}" for p in
                     check_decision(dep, expect, FLEET_INTENTS, delivered_view(dep, outcome), True, source)]
    assert not problems, "\n".join(problems)


# -- the pool-review cases --------------------------------------------------------------------------

@pytest.mark.parametrize("case", divergent(POOL["cases"]))
def test_pool_review_case(world, case):
    deployment = {"pack": "pool-review.json", "params": pool_params(case), "topology": POOL_TOPOLOGY}
    dep = deploy(world, deployment)
    source, body, headers = case_body(case)
    assert source == "generic" and case["verified"] is False  # pool hooks: unsigned, token-trust generic hooks
    hook = router_hook(dep, source, deployment)
    result = dry_run(dep, hook, body, headers, False)
    problems = [f"dry run: {p}" for p in
                check_decision(dep, case["expect"], POOL_INTENTS, dry_run_view(result), False, source)]
    # A real post as the producer sends it: the reference recorded secret-bearing headers as placeholders.
    outcome = dep.deliver(hook, json.dumps(body).encode(), {k: v for k, v in headers.items() if v != REDACTED})
    problems += [f"delivered: {p}" for p in
                 check_decision(dep, case["expect"], POOL_INTENTS, delivered_view(dep, outcome), False, source)]
    assert not problems, "\n".join(problems)


# -- what the reference's unit tests assert about subjects, work orders and envelope paths -------------

def projection_subject_problems(item: dict, result: dict) -> list[str]:
    problems, envelope, order = [], result["envelope"], result["work_order"]
    subject = item["subject"]
    if subject is None:
        if envelope["issue"] is not None:
            problems.append(f".issue is {envelope['issue']}, expected null (no subject)")
        return problems
    if subject["type"] == "issue":
        issue = envelope["issue"]
        if issue is None:
            return [f".issue is null, expected an issue subject {subject}"]
        for field, want in subject.items():
            if field != "type" and issue.get(field) != want:
                problems.append(f".issue.{field} is {issue.get(field)!r}, expected {want!r}")
    elif envelope.get("subject_key") != subject["key"]:
        problems.append(f"subject_key {envelope.get('subject_key')!r}, expected {subject['key']!r}")
    if order is not None:  # the subject a worker receives
        got = order["subject"] or {}
        for field, want in subject.items():
            if field != "key" and got.get(field, "<absent>") != want:
                problems.append(f"work order subject.{field} is {got.get(field, '<absent>')!r}, expected {want!r}")
    return problems


def work_order_problems(item: dict, result: dict) -> list[str]:
    order, want = result["work_order"], item["work_order"]
    if order is None:
        return [f"no work order ({result['decision']['disposition']} by {result['trace'].get('rule_id')})"]
    problems = []
    for field, value in want.items():
        if field == "authorized_by":
            if order["authorized_by"].get("rule_id") not in FLEET_INTENTS[value["rule_id"]]:
                problems.append(f"authorized_by {order['authorized_by']}, expected the intent of {value['rule_id']}")
        elif field == "subject":
            for key, v in value.items():
                if order["subject"].get(key) != v:
                    problems.append(f"subject.{key} is {order['subject'].get(key)!r}, expected {v!r}")
        elif order.get(field) != value:
            problems.append(f"{field} is {order.get(field)!r}, expected {value!r}")
    if len(order["subject"].get("tags") or []) != item["work_order_subject_tags_count"]:
        problems.append(f"subject.tags {order['subject'].get('tags')}")
    problems += [f"authority lacks {s!r}" for s in item["authority_contains"] if s not in order["authority"]]
    return problems


def envelope_jq_problems(dep, hook: dict, body, headers: dict, exprs: list[str]) -> list[str]:
    """Each documented path, as a candidate rule on the dry run: the real sandboxed evaluator says whether it
    matches our envelope."""
    problems = []
    for expr in exprs:
        probe = {"id": "probe", "expr": expr, "action": {"drop": True}}
        result = dry_run(dep, hook, body, headers, True, rules=[probe])
        if result["decision"]["fault"] is not None:
            problems.append(f"{expr}: faulted {result['decision']['fault']}")
        elif result["trace"]["stage"] != "rule":
            problems.append(f"{expr}: does not match")
    return problems


@pytest.mark.parametrize("item", PROJECTIONS["items"], ids=[i["name"] for i in PROJECTIONS["items"]])
def test_reference_projection(world, item):
    dep = deploy(world, FLEET_DEPLOYMENT)
    smp = sample(item["sample"])
    source = item.get("source", smp["source"])
    body = producers.deep_merge(smp["body"], item["patch"]) if item.get("patch") else smp["body"]
    headers = dict(smp["headers"])
    hook = router_hook(dep, source, FLEET_DEPLOYMENT)
    result = dry_run(dep, hook, body, headers, True)
    problems = []
    if result["decision"]["fault"] is not None:
        problems.append(f"the fleet pack faulted: {result['decision']['fault']}")
    if "subject" in item:
        problems += projection_subject_problems(item, result)
    if "work_order" in item:
        problems += work_order_problems(item, result)
    if "envelope_jq" in item:
        problems += envelope_jq_problems(dep, hook, body, headers, item["envelope_jq"])
    assert not problems, "\n".join(problems)
