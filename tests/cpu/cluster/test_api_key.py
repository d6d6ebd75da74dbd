"""The ingress API key (`api_key_file`): Bearer check on the /v1 routes, 401 in OpenAI's shape.

The check itself without Ray, then the real app on local Ray called with the `openai` client:
the right key is served, a wrong or missing one is refused before any work, and /health
stays open for Kubernetes probes.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from outrider.cluster.ingress import check_api_key, read_api_key
from outrider.cluster.openai_api import ApiError

KEY = "sk-outrider-test-4f1c"


def test_check_api_key_accepts_only_the_bearer_key():
    check_api_key(f"Bearer {KEY}", KEY)
    check_api_key(f"bearer {KEY}", KEY)  # the scheme is case-insensitive (RFC 7235)
    check_api_key(None, None)  # no key configured: an open API
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer "):
        with pytest.raises(ApiError) as refused:
            check_api_key(header, KEY)
        assert refused.value.status == 401
        body = refused.value.body()["error"]
        assert body["type"] == "invalid_request_error" and body["code"] == "invalid_api_key"
        assert KEY not in body["message"]


def test_read_api_key(tmp_path):
    assert read_api_key(None) is None
    (tmp_path / "key").write_text(f"  {KEY}\n")  # as `kubectl create secret --from-file` may leave it
    assert read_api_key(str(tmp_path / "key")) == KEY
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError):
        read_api_key(str(tmp_path / "absent"))


@pytest.mark.slow  # a local Ray cluster: ~20 s on 2 cores
def test_served_app_refuses_requests_without_the_key(tiny_family, tmp_path):
    openai = pytest.importorskip("openai")
    from serve_testlib import MODEL, deploy, get, local_serve

    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    with local_serve() as url:
        deploy("keyed", {"no_speculation": True, "api_key_file": str(key_file)}, tiny_family)
        base = f"{url}/keyed/v1"

        good = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        completion = good.completions.create(model=MODEL, prompt="import os\n", max_tokens=4, temperature=0)
        assert completion.usage.completion_tokens > 0
        assert [m.id for m in good.models.list()] == [MODEL]

        bad = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            bad.completions.create(model=MODEL, prompt="import os\n", max_tokens=4)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])

        # No header at all, on every /v1 route; the probe and scrape routes stay open.
        for route, body in (("completions", {"model": MODEL, "prompt": "x"}), ("models", None)):
            data = json.dumps(body).encode() if body else None
            request = urllib.request.Request(
                f"{base}/{route}", data=data, headers={"Content-Type": "application/json"}
            )
            with pytest.raises(urllib.error.HTTPError) as error:
                urllib.request.urlopen(request, timeout=30)
            assert error.value.code == 401
            assert error.value.headers["WWW-Authenticate"] == "Bearer"
            assert json.loads(error.value.read())["error"]["code"] == "invalid_api_key"
        assert get(f"{url}/keyed/health")[0] == 200
        status, page = get(f"{url}/keyed/metrics")
        refusals = [
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("outrider:request_errors_total{") and 'status="401"' in line
        ]
        assert status == 200 and refusals == [4.0]  # two through openai, two without a header
