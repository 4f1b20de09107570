"""GET /api/v1/openapi.json: a valid OpenAPI 3.1 document generated from the models the routes validate with,
covering every route the app mounts; and the answer models it publishes match what the API really answers."""

from __future__ import annotations

import producers
import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from switchboard.configuration import VERSION
from switchboard.http.rest import REST_ROUTES, documented_path
from switchboard.models import ClaimAnswer, DeliveryAnswer, ErrorAnswer, TodoAnswer, TodoListAnswer


@pytest.fixture
def document(client) -> dict:
    answer = client.get("/api/v1/openapi.json")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json")
    return answer.json()


def test_the_document_is_valid_openapi_3_1_and_needs_no_credential(document):
    assert document["openapi"] == "3.1.0" and document["info"]["version"] == VERSION
    validate(document)


def test_every_mounted_route_and_method_is_documented(app, document):
    mounted = {(documented_path(route.path), method.lower()) for route in app.routes if isinstance(route, Route)
               for method in route.methods if method != "HEAD"}
    documented = {(path, method) for path, operations in document["paths"].items() for method in operations}
    assert mounted == documented
    assert ("/api/v1/todos/{todo_id}/heartbeat", "post") in documented


def test_every_body_and_query_schema_is_the_models_own(document):
    schemas = document["components"]["schemas"]
    for route in REST_ROUTES:
        operation = document["paths"][documented_path(route.path)][route.method.lower()]
        if route.body is not None:
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            expected = route.body.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, definition in expected.pop("$defs", {}).items():
                assert schemas[name] == definition
            assert ref == f"#/components/schemas/{route.body.__name__}" and schemas[route.body.__name__] == expected
        else:
            assert "requestBody" not in operation, route.path
        if route.query is not None:
            names = {p["name"] for p in operation["parameters"] if p["in"] == "query"}
            assert names == set(route.query.model_fields)


def test_real_answers_fit_the_published_answer_models(world, alice):
    """Push, list, claim, heartbeat, get and a signed delivery, each validated against its answer model (which
    refuses unknown fields), so the document cannot drift from the code."""
    endpoint = world.endpoint(alice, ["build"])
    pushed = world.client.post(f"/api/v1/endpoints/{endpoint.id}/todos", headers=alice.auth,
                               json={"title": "t", "queue": "build", "payload": {"n": 1}})
    TodoAnswer.model_validate(pushed.json())
    TodoListAnswer.model_validate(world.client.get("/api/v1/todos", headers=alice.auth).json())
    claim = world.client.post("/api/v1/todos/claim", headers=endpoint.auth, json={}).json()
    ClaimAnswer.model_validate(claim)
    beat = world.client.post(f"/api/v1/todos/{claim['todo']['id']}/heartbeat", headers=endpoint.auth,
                             json={"lease_token": claim["lease_token"], "note": "busy"})
    TodoAnswer.model_validate(beat.json())
    detail = world.client.get(f"/api/v1/todos/{claim['todo']['id']}", headers=alice.auth).json()
    assert TodoAnswer.model_validate(detail).history
    ClaimAnswer.model_validate(world.client.post("/api/v1/todos/claim", headers=endpoint.auth, json={}).json())
    ErrorAnswer.model_validate(world.client.get("/api/v1/todos/td_00", headers=alice.auth).json())
    hook = world.client.post("/api/v1/webhooks", headers=alice.auth,
                             json={"provider": "github", "queue": "build", "endpoint_id": endpoint.id,
                                   "trusted_actors": {"allow_all": True}}).json()
    raw, headers = producers.github("issues.opened", hook["secret"])
    delivered = world.client.post(hook["url"].split("testserver", 1)[1], content=raw, headers=headers)
    assert delivered.status_code == 202
    DeliveryAnswer.model_validate(delivered.json())
