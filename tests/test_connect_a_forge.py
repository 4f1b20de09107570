"""docs/connect-a-forge.md's table of the events to select on a forge's webhook page is the set of events the
shipped packs route: a reader who selects those (and no more) gets every delivery a pack acts on. The events a pack
routes are read from its own cases (packs/<pack>.cases.json), which tests/test_packs.py runs through the real
rule sandbox: the header each routed case's delivery carries (GitHub's `X-GitHub-Event`, Gitea's
`X-Gitea-Event-Type`)."""

from __future__ import annotations

import json
import re

from conftest import ROOT

PAGE = ROOT / "docs" / "connect-a-forge.md"
PACKS = ROOT / "packs"
FIXTURES = ROOT / "tests" / "fixtures"
FORGES = {"GitHub": "github", "Gitea": "gitea"}


def routed_events() -> dict[tuple[str, str], set[str]]:
    """(pack, provider) -> the event headers of the deliveries its cases expect routed."""
    events: dict[tuple[str, str], set[str]] = {}
    for path in sorted(PACKS.glob("*.cases.json")):
        cases = json.loads(path.read_text())
        pack = path.name.removesuffix(".cases.json")
        for case in cases["cases"]:
            if case["provider"] not in FORGES.values() or case["expect"].get("disposition") != "routed":
                continue
            if case["provider"] == "github":
                event = case.get("headers", {}).get("X-GitHub-Event", case["fixture"].split(".")[0])
            else:
                shipped = json.loads((FIXTURES / "gitea" / f"{case['fixture']}.json").read_text())["headers"]
                event = {**shipped, **case.get("headers", {})}["X-Gitea-Event-Type"]
            events.setdefault((pack, case["provider"]), set()).add(event)
    return events


def documented_events() -> dict[tuple[str, str], set[str]]:
    """(pack, provider) -> the events the page's table lists in its last column."""
    text = PAGE.read_text()
    table = text[text.index("| pack | forge |"):]
    table = table[:table.index("\n\n")]
    rows = {}
    for line in table.splitlines()[2:]:
        pack, forge, _, events = [cell.strip() for cell in line.strip("|").split("|")]
        rows[(pack, FORGES[forge])] = set(re.findall(r"`([a-z_]+)`", events))
    return rows


def test_the_events_to_select_are_the_events_the_packs_route():
    routed, documented = routed_events(), documented_events()
    assert routed, "the packs' cases route no forge delivery: the comparison would prove nothing"
    assert documented == routed, f"the page lists {documented}, the packs route {routed}"


def test_github_default_push_alone_routes_nothing_in_the_seed_loop():
    """What the page warns of: GitHub's default selection (the push event) reaches no lane of the fleet pack."""
    assert "push" not in routed_events()[("fleet", "github")]
    assert 'GitHub\'s default, "Just the\npush event", delivers nothing the fleet pack routes' in PAGE.read_text()
