"""A worker's comment as the forge will show and receive it (issue 43, items 3 to 5): secrets hidden in what the
forge renders, this server's own secrets, mentions that would still ping, and a comment's size as sent.

The app runs with its forge sender on; GitHub and Gitea are played by tests/forges.py, which records what is posted.
A refused comment is a 400 naming why (never the secret), leaves the database as it was and sends nothing."""

from __future__ import annotations

import time

import pytest
from conftest import ManualClock, snapshot
from forges import REPO, FakeForge, Scene
from helpers import hook_token

from switchboard.app import create_app
from switchboard.store.outputs import WORD_JOINER

TOKEN = "ghp_" + "F0rgeT0ken" * 4
GITEA_TOKEN = "0123456789abcdef" * 2 + "01234567"
BOT = "switchboard-bot"
# Credentials of known shapes that are not this server's (the shape alone refuses them).
OTHER_GITHUB = "ghp_" + "A1b2C3d4E5" * 3 + "f6G7h8"
OTHER_HEX = "a1b2c3d4e5" * 4
OTHER_SWITCHBOARD = "sbh_" + "Zz9_-" * 8 + "abc"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time_ns() // 1_000_000)


@pytest.fixture
def app(db_path, clock):
    return create_app(db_path, clock=clock, background=True, notify_allow_private=True)


@pytest.fixture
def github():
    forge = FakeForge("github", TOKEN, BOT)
    yield forge
    forge.stop()


@pytest.fixture
def gitea():
    forge = FakeForge("gitea", GITEA_TOKEN, BOT)
    yield forge
    forge.stop()


@pytest.fixture
def scene(world, alice, github) -> Scene:
    return Scene(world, alice, github)


def _claimed(scene: Scene, number: int) -> tuple[str, str]:
    todo_id = scene.open_issue(number)
    return todo_id, scene.claim(todo_id)


def _refused(scene: Scene, forge: FakeForge, db_path: str, issue: int | tuple[str, str], body: str,
             secret: str | None = None) -> str:
    """Ask for one comment `body` on a new issue's claimed todo (or on `issue`, a todo and its lease); it must be
    refused and change nothing. The refusal's message."""
    todo_id, lease = _claimed(scene, issue) if isinstance(issue, int) else issue
    before = snapshot(db_path)
    answer = scene.act(todo_id, "outputs", lease_token=lease, outputs=[{"type": "comment", "body": body}])
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_argument"
    assert secret is None or secret not in answer.text
    assert snapshot(db_path) == before
    assert forge.writes() == []
    return answer.json()["message"]


# -- item 4: secrets as the forge renders them ---------------------------------------------------------------------

@pytest.mark.parametrize("body, kind, secret", [
    (f"set key_{OTHER_GITHUB} in CI", "a GitHub token", OTHER_GITHUB),
    (f"x_{OTHER_SWITCHBOARD}", "a Switchboard token", OTHER_SWITCHBOARD),
    ("gh\u200bp_" + OTHER_GITHUB[4:], "a GitHub token", OTHER_GITHUB[4:]),
    (OTHER_GITHUB[:12] + "\u00ad" + OTHER_GITHUB[12:], "a GitHub token", OTHER_GITHUB[12:]),
    (OTHER_GITHUB[:20] + "\ufeff" + OTHER_GITHUB[20:], "a GitHub token", OTHER_GITHUB[20:]),
    ("-----BEGIN RSA PRI\u200bVATE KEY-----\nMIIE…", "a private key", None),
    ("-----BEGIN OPENSSH PRIVATE\u00ad KEY-----\nb3Bl…", "a private key", None),
    ("ghp\\_" + OTHER_GITHUB[4:], "a GitHub token", OTHER_GITHUB[4:]),
    ("ghp&#95;" + OTHER_GITHUB[4:], "a GitHub token", OTHER_GITHUB[4:]),
    ("ghp&#x5F;" + OTHER_GITHUB[4:], "a GitHub token", OTHER_GITHUB[4:]),
    ("ghp&lowbar;" + OTHER_GITHUB[4:], "a GitHub token", OTHER_GITHUB[4:]),
    ("gh<!-- -->p_" + OTHER_GITHUB[4:], "a GitHub token", OTHER_GITHUB[4:]),
    ("gh<span></span>p_" + OTHER_GITHUB[4:], "a GitHub token", OTHER_GITHUB[4:]),
    (f"export GITEA_TOKEN={OTHER_HEX}", "a Gitea or other hex token", OTHER_HEX),
    (f"https://git.example/api/v1/repos?access_token={OTHER_HEX}", "a Gitea or other hex token", OTHER_HEX),
    (f"Authorization: token {OTHER_HEX}", "a Gitea or other hex token", OTHER_HEX),
], ids=["glued by _", "switchboard glued by _", "zero-width space", "soft hyphen", "BOM", "key header zero-width",
        "key header soft hyphen", "markdown escape", "decimal entity", "hex entity", "named entity", "html comment",
        "empty tag", "GITEA_TOKEN=", "access_token=", "authorization token"])
def test_a_credential_hidden_from_the_raw_text_is_refused_by_what_it_is(scene, github, db_path, body, kind, secret):
    message = _refused(scene, github, db_path, 100, body, secret)
    assert message == f"outputs[0]: the comment holds what looks like {kind}; it is never posted"


def test_ordinary_text_near_those_shapes_is_posted(scene, github):
    """A commit hash, a word ending in sk, an e-mail and a code span with an escape are not credentials."""
    body = ("Fixed in 0123456789abcdef0123456789abcdef01234567 (the secret is rotated), see task-assessment-for-"
            "the-whole-thing, mail ops@example.org, `a\\_b`")
    todo_id, lease = _claimed(scene, 101)
    answer = scene.act(todo_id, "outputs", lease_token=lease, outputs=[{"type": "comment", "body": body}])
    assert answer.status_code == 200, answer.text
    [sent] = scene.settled(todo_id)
    assert github.comments(REPO, 101)[0]["body"] == f"{body}\n\n<!-- switchboard:{sent['id']} -->"


# -- item 4: this server's own secrets, verbatim ----------------------------------------------------------------------

def test_the_connections_own_token_is_refused_even_where_no_shape_finds_it(scene, github, db_path):
    # A letter before it hides the GitHub prefix from the shapes; the connection's own token is still found.
    message = _refused(scene, github, db_path, 110, f"token: a{TOKEN}", TOKEN)
    assert message == ("outputs[0]: the comment holds this server's own secret (the forge connection's token); it is"
                       " never posted")


def test_a_gitea_connections_hex_token_is_refused(world, alice, gitea, db_path):
    scene = Scene(world, alice, gitea)
    claimed = _claimed(scene, 111)
    for body in (f"the one we use was {GITEA_TOKEN}, keep it", f"UPPER {GITEA_TOKEN.upper()}",
                 GITEA_TOKEN[:10] + "\u200b" + GITEA_TOKEN[10:]):
        message = _refused(scene, gitea, db_path, claimed, body, GITEA_TOKEN[10:])
        assert message.endswith("this server's own secret (the forge connection's token); it is never posted")


def test_an_ingest_url_token_is_refused(scene, github, db_path):
    url = scene.hook["url"]
    token = hook_token(url)
    claimed = _claimed(scene, 114)
    for body in (f"deliveries go to {url}", f"the hook is x{token}y", token[:5] + "&#8203;" + token[5:]):
        message = _refused(scene, github, db_path, claimed, body, token)
        assert message.endswith("this server's own secret (a webhook's ingest URL token); it is never posted")


def test_an_endpoint_or_human_token_is_refused(scene, github, db_path):
    endpoint_token, human_token = scene.endpoint.token, scene.human.token
    # Standing alone, the shape refuses them; glued to a word, only the lookup of their hashes finds them.
    assert _refused(scene, github, db_path, 117, f"use {endpoint_token}", endpoint_token).endswith(
        "looks like a Switchboard token; it is never posted")
    assert _refused(scene, github, db_path, 118, f"key{endpoint_token}", endpoint_token).endswith(
        "this server's own secret (an endpoint's token); it is never posted")
    assert _refused(scene, github, db_path, 119, f"key{human_token}", human_token).endswith(
        "this server's own secret (a human's token); it is never posted")


# -- item 5: mentions that would still ping -------------------------------------------------------------------------

def test_every_mention_that_pings_on_github_or_gitea_is_neutralised_in_what_is_sent(scene, github):
    body = ("thanks &#64;alice, &commat;bob, &#x40;carol and &#0064;dan; -@erin +@fay .@gus _x_@hal (@ivy) [@jo]\n"
            "@kim\\@lee é@max a@b.example https://example.com/@ned")
    todo_id, lease = _claimed(scene, 120)
    assert scene.act(todo_id, "outputs", lease_token=lease,
                     outputs=[{"type": "comment", "body": body}]).status_code == 200
    [sent] = scene.settled(todo_id)
    j = WORD_JOINER
    assert github.comments(REPO, 120)[0]["body"] == (
        f"thanks &#64;{j}alice, &commat;{j}bob, &#x40;{j}carol and &#0064;{j}dan; -@{j}erin +@{j}fay .@{j}gus"
        f" _x_@{j}hal (@{j}ivy) [@{j}jo]\n"
        f"@{j}kim\\@{j}lee é@{j}max a@b.example https://example.com/@ned\n\n<!-- switchboard:{sent['id']} -->")


# -- item 3: the size as sent ----------------------------------------------------------------------------------------

def test_a_comment_at_the_policy_cap_is_refused_when_its_marker_would_pass_what_a_forge_takes(world, alice, github,
                                                                                                db_path):
    scene = Scene(world, alice, github, policy={"comment": {"max": 3, "max_bytes": 65536}})
    message = _refused(scene, github, db_path, 130, "x" * 65536)
    assert message.startswith("outputs[0]: the comment is 65536 bytes and its marker")
    assert message.endswith("over the 65536 bytes a forge takes in one comment")
    # The largest that fits is posted whole, and what the forge receives, marker included, is within 65,536.
    todo_id, lease = _claimed(scene, 131)
    fits = scene.act(todo_id, "outputs", lease_token=lease, outputs=[{"type": "comment", "body": "x" * 65489}])
    assert fits.status_code == 200, fits.text
    [sent] = scene.settled(todo_id)
    assert sent["state"] == "sent"
    posted = github.comments(REPO, 131)[0]["body"]
    assert posted.startswith("x" * 65489) and len(posted.encode()) <= 65536 and len(posted) <= 65536


def test_the_policys_max_bytes_counts_the_mention_guards(world, alice, github, db_path):
    scene = Scene(world, alice, github, policy={"comment": {"max": 3, "max_bytes": 1000}})
    message = _refused(scene, github, db_path, 132, "@al " * 250)
    assert message.startswith("outputs[0]: the comment is 1750 bytes, over the policy's max_bytes of 1000")
