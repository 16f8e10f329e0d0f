"""The OpenAPI document says what the server does: 400 (not FastAPI's 422) in OpenAI's error shape, the other
errors each route can answer, event streams on the generation routes, and 405 with Allow for a wrong method.
No model is needed: the app answers these before any engine work (the document, the body's validation, the
method check)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pagoda.server.api import build_app
from pagoda.server.state import ServerState


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(ServerState(model_name="m"))) as test_client:
        yield test_client


def test_no_route_documents_422_and_bodies_document_400(client):
    document = client.get("/openapi.json").json()
    assert "422" not in json.dumps(document["paths"])
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = document["paths"][path]["post"]["responses"]
        assert {"400", "401", "413"} <= set(responses), path
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIErrorResponse")
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert "text/event-stream" in responses["200"]["content"]
        assert "Retry-After" in responses["429"]["headers"]
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(document["paths"]["/health"]["get"]["responses"]) == {"200", "503"}


def test_an_invalid_body_is_the_documented_400(client):
    response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": "four"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "max_tokens"


def test_a_wrong_method_is_405_with_allow(client):
    response = client.get("/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == 405


def test_stop_token_ids_are_counted_before_they_are_validated(client):
    response = client.post("/v1/completions", json={"prompt": "a", "stop_token_ids": [1] * 1025})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids" and "at most 1024" in error["message"]
