"""Bad input answered 500 or 400 where a 4xx naming the field, or a 403 for the wrong token, is due (issue 43,
item 8), through the real app: each leaves the database as it was."""

from __future__ import annotations

import pytest
from conftest import snapshot


@pytest.fixture
def worker(world, alice):
    return world.endpoint(alice, ["triage"], name="worker", verbs=["all"])


def test_a_pause_duration_past_the_year_9999_is_a_400_naming_until(world, alice, worker, db_path):
    before = snapshot(db_path)
    for until in ("999999d999999d999999d999999d", "999999d999999d999999d"):
        answer = world.client.post(f"/api/v1/endpoints/{worker.id}/queues/triage/pause", headers=alice.auth,
                                   json={"until": until})
        assert answer.status_code == 400, answer.text
        assert answer.json() == {"error": "invalid_argument",
                                 "message": f"until: {until} from now is past the year 9999 in UTC"}
    assert snapshot(db_path) == before
    # A long pause that ends in range still works.
    assert world.client.post(f"/api/v1/endpoints/{worker.id}/queues/triage/pause", headers=alice.auth,
                             json={"until": "999999d"}).status_code == 200


@pytest.mark.parametrize("body", [b"{not json", b'{"lease_token": 7}', b""], ids=["garbage", "wrong type", "empty"])
def test_the_wrong_token_kind_is_403_before_the_body_is_read(world, alice, worker, db_path, body):
    pushed = world.push(alice, worker, "triage")
    hook = world.webhook(alice, worker, "github", "triage")
    before = snapshot(db_path)
    as_human = world.client.post(f"/api/v1/todos/{pushed['id']}/outputs", headers=alice.auth, content=body)
    assert as_human.status_code == 403, as_human.text
    assert as_human.json() == {"error": "forbidden",
                               "message": "POST /api/v1/todos/{todo_id}/outputs needs an endpoint token"}
    as_endpoint = world.client.put(f"/api/v1/webhooks/{hook['id']}/connection", headers=worker.auth, content=body)
    assert as_endpoint.status_code == 403, as_endpoint.text
    assert as_endpoint.json() == {"error": "forbidden",
                                  "message": "PUT /api/v1/webhooks/{webhook_id}/connection needs a human token"}
    assert snapshot(db_path) == before
