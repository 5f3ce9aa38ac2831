"""Authentication, roles, writer ownership and forged finishes, through a real server (issue 13, item 4).

A service started with REPLAY_TOKENS_FILE answers 401 without a known bearer token and 403 for a wrong
role, a run outside the token's prefix or another writer's request; without a tokens file it refuses a
non-loopback address unless told --insecure. A finish below the stored rows is a 409, never a truncation.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.routing import APIRoute
from typer.testing import CliRunner

from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_service.api.auth import ROUTE_NEEDS, Role, listen_refusal, load_tokens, need_of
from replay_service.app import WEB_DIR, create_app
from replay_service.ops import cli
from tests.support.browser import browser, new_page, require_browser, set_hash
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, calls

READ, WRITE, WRITE2, ADMIN, TEAM = ("r" * 24, "w" * 24, "v" * 24, "a" * 24, "t" * 24)
TOKENS = f"""# test tokens
{READ} read
{WRITE} write
{WRITE2} write   # a second writer
{ADMIN} admin
{TEAM} write team-a-
"""
ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def rows(run: str, request: str, n: int, writer: str = "w", seq: int = 0, first: int = 0) -> bytes:
    experts = routes(np.random.default_rng(seq), n)
    return batch_bytes(run, writer, seq, [request] * n, np.arange(first, first + n), experts)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A service with the tokens above."""
    root = tmp_path_factory.mktemp("auth")
    (root / "tokens").write_text(TOKENS)
    with ServiceProcess(root / "data", env={"REPLAY_TOKENS_FILE": str(root / "tokens")}) as proc:
        with httpx.Client(base_url=proc.url, timeout=30) as http:
            assert http.post("/v1/ingest", content=rows("auth-run", "seed", 4), headers={**ARROW, **bearer(WRITE)},
                             ).status_code == 200
            yield http


def test_a_forged_finish_is_refused_not_a_truncation(shared_service):
    # issue 13 item 4: a finish below the stored rows silently cut the route and strict reads still answered 200
    with httpx.Client(base_url=shared_service.url, timeout=30) as http:
        assert http.post("/v1/ingest", content=rows("forged-finish", "r", 10), headers=ARROW).status_code == 200
        forged = http.post("/v1/runs/forged-finish/requests/r/finish", json={"num_tokens": 5})
        assert forged.status_code == 409, forged.text
        assert "num_tokens=5" in forged.json()["detail"] and "position 9" in forged.json()["detail"]
        summary = http.get("/v1/runs/forged-finish/requests/r").json()
        assert summary["rows"] == 10 and summary["status"] == "open"
        real = http.post("/v1/runs/forged-finish/requests/r/finish", json={"num_tokens": 11})
        assert real.status_code == 200 and real.json()["num_tokens"] == 11
        strict = http.get("/v1/runs/forged-finish/requests/r/routes", params={"format": "npy", "strict": True})
        assert strict.status_code == 200
        assert np.load(__import__("io").BytesIO(strict.content)).shape[0] == 10


ROUTES = [  # (method, path, body kwargs, the role it needs)
    ("GET", "/v1/runs", {}, Role.READ),
    ("GET", "/v1/runs/auth-run", {}, Role.READ),
    ("GET", "/v1/runs/auth-run/requests", {}, Role.READ),
    ("GET", "/v1/runs/auth-run/requests/seed/routes?format=json", {}, Role.READ),
    ("POST", "/v1/runs/auth-run/routes/batch", {"json": {"requests": ["seed"]}}, Role.READ),
    ("POST", "/v1/trainer/megatron", {"json": {"sequences": [{"run": "auth-run", "request": "seed"}]}}, Role.READ),
    ("GET", "/metrics", {}, Role.READ),
    ("POST", "/v1/runs/auth-run/requests/x/finish", {"json": {"num_tokens": 3}}, Role.WRITE),
    ("PUT", "/v1/runs/auth-run/pin", {}, Role.ADMIN),
]


@pytest.mark.parametrize(("method", "path", "body", "role"), ROUTES, ids=[f"{m} {p}" for m, p, _, _ in ROUTES])
def test_the_401_403_matrix(secured, method, path, body, role):
    for headers in ({}, bearer("not-a-token-at-all-xx"), {"authorization": f"Basic {READ}"}):
        answer = secured.request(method, path, headers=headers, **body)
        assert answer.status_code == 401, (headers, answer.text)
        assert answer.headers["www-authenticate"] == "Bearer" and answer.json()["detail"]
    for token, has in ((READ, Role.READ), (WRITE, Role.WRITE), (ADMIN, Role.ADMIN)):
        answer = secured.request(method, path, headers=bearer(token), **body)
        if has.rank < role.rank:
            assert answer.status_code == 403 and f"needs a {role} token" in answer.json()["detail"], answer.text
        else:
            assert answer.status_code not in (401, 403), (token, answer.text)


def test_open_paths_need_no_token(secured):
    for path in ("/healthz", "/openapi.json", "/docs", "/", "/js/api.js"):
        assert secured.get(path).status_code == 200, path


def test_a_read_token_cannot_write(secured):
    answer = secured.post("/v1/ingest", content=rows("auth-read", "r", 3), headers={**ARROW, **bearer(READ)})
    assert answer.status_code == 403
    assert secured.get("/v1/runs/auth-read", headers=bearer(ADMIN)).status_code == 404


def test_a_run_prefix_limits_the_token(secured):
    team = {**ARROW, **bearer(TEAM)}
    assert secured.post("/v1/ingest", content=rows("team-a-1", "r", 3), headers=team).status_code == 200
    outside = secured.post("/v1/ingest", content=rows("team-b-1", "r", 3), headers=team)
    assert outside.status_code == 403 and "'team-a-'" in outside.json()["detail"]
    assert secured.get("/v1/runs/team-b-1", headers=bearer(ADMIN)).status_code == 404  # nothing was stored
    assert secured.get("/v1/runs/team-a-1", headers=bearer(TEAM)).status_code == 200
    assert secured.get("/v1/runs/auth-run", headers=bearer(TEAM)).status_code == 403
    assert secured.get("/v1/runs", headers=bearer(TEAM)).status_code == 403  # lists every run
    mine = {"sequences": [{"run": "team-a-1", "request": "r"}]}
    theirs = {"sequences": [{"run": "team-a-1", "request": "r"}, {"run": "auth-run", "request": "seed"}]}
    assert secured.post("/v1/trainer/megatron", json=mine, headers=bearer(TEAM)).status_code == 200
    assert secured.post("/v1/trainer/megatron", json=theirs, headers=bearer(TEAM)).status_code == 403


def test_a_request_takes_rows_and_its_finish_from_its_writer_only(secured):
    # issue 13 item 4: anyone could write into another writer's request (flagging its rows CONFLICT) or end it
    mine, other = {**ARROW, **bearer(WRITE)}, {**ARROW, **bearer(WRITE2)}
    assert secured.post("/v1/ingest", content=rows("owned", "r", 6), headers=mine).status_code == 200
    squat = secured.post("/v1/ingest", content=rows("owned", "r", 6, writer="x", seq=1), headers=other)
    assert squat.status_code == 403 and "another token" in squat.json()["detail"]
    summary = secured.get("/v1/runs/owned/requests/r", headers=bearer(READ)).json()
    assert summary["rows"] == 6 and summary["flagged"].get("CONFLICT", 0) == 0, summary
    finish = "/v1/runs/owned/requests/r/finish"
    assert secured.post(finish, json={"num_tokens": 7}, headers=bearer(WRITE2)).status_code == 403
    assert secured.post("/v1/runs/owned/requests/r/routes?finish=false", content=rows("owned", "r", 1, first=6),
                        headers=other).status_code == 403
    # another request of the same run is the second writer's to claim
    assert secured.post("/v1/ingest", content=rows("owned", "s", 2, writer="x", seq=2), headers=other).status_code \
        == 200
    refs = {"references": [{"request_id": "r", "start": 0, "end": 2, "source_request_id": "s"}]}
    refused = secured.post("/v1/runs/owned/references", json=refs, headers=bearer(WRITE2))  # into another's request
    assert refused.status_code == 403 and "another token" in refused.json()["detail"]
    assert secured.get("/v1/runs/owned/requests/r", headers=bearer(READ)).json()["referenced_rows"] == 0
    assert secured.post(finish, json={"num_tokens": 7}, headers=bearer(WRITE)).status_code == 200
    assert secured.post("/v1/runs/owned/requests/s/finish", json={"num_tokens": 3},
                        headers=bearer(ADMIN)).status_code == 200  # an admin may end anyone's request


def test_the_client_sends_its_token(secured):
    url = str(secured.base_url)
    with ReplayClient(url, token=READ) as client:
        assert client.run("auth-run").run_id == "auth-run"
    with ReplayClient(url, token=None) as client, pytest.raises(Exception, match="401"):
        client.run("auth-run")


def test_every_route_has_a_role():
    """A new route is never unprotected by accident: each resolves to a need, every POST is declared."""
    app = create_app()
    declared = set()
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        for method in route.methods:
            need = need_of(method, route.path)
            declared.add((method, route.path))
            if method in ("POST", "PUT", "PATCH"):
                assert (method, route.path) in ROUTE_NEEDS, f"{method} {route.path}: declare its role in ROUTE_NEEDS"
            if need.role is None:
                assert route.path == "/healthz", f"{method} {route.path} is open"
    assert set(ROUTE_NEEDS) <= declared, f"ROUTE_NEEDS names routes that do not exist: {set(ROUTE_NEEDS) - declared}"


def test_the_tokens_file_is_checked(tmp_path):
    good = tmp_path / "good"
    good.write_text(TOKENS)
    assert [g.role for g in load_tokens(good)] == ["read", "write", "write", "admin", "write"]
    for text, problem in ((f"{READ} root\n", "role 'root'"), ("short read\n", "16 characters"),
                          (f"{READ}\n", "token role"), (f"{READ} read\n{READ} admin\n", "twice"),
                          ("# none\n", "no tokens")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match=problem):
            load_tokens(bad)


def test_without_tokens_serve_stays_on_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv("REPLAY_TOKENS_FILE", raising=False)
    refused = CliRunner().invoke(cli.app, ["serve", "--data", str(tmp_path / "data"), "--host", "0.0.0.0"])
    assert refused.exit_code == 2
    assert "--insecure" in refused.output and "REPLAY_TOKENS_FILE" in refused.output
    assert not (tmp_path / "data").exists()  # refused before the store was made
    assert listen_refusal("127.0.0.1", None, False) is None and listen_refusal("::1", None, False) is None
    assert listen_refusal("example.org", None, False) is not None  # a name may resolve anywhere
    assert listen_refusal("0.0.0.0", Path("tokens"), False) is None and listen_refusal("0.0.0.0", None, True) is None


def test_insecure_serves_a_public_address(tmp_path):
    with ServiceProcess(tmp_path / "data", args=["--host", "0.0.0.0", "--insecure"]) as proc:
        assert calls.get(f"{proc.url}/v1/runs", timeout=10).status_code == 200


# the sessionStorage key the web view keeps its token under (web/js/api.js)
TOKEN_KEY = re.search(r'^export const TOKEN_KEY = "([^"]+)";$', (WEB_DIR / "js" / "api.js").read_text(), re.M).group(1)


def test_web_view_asks_for_its_token_in_a_form(tmp_path):
    """Headless Chromium against a service with a tokens file: a form in the page, never a native dialog."""
    require_browser()
    (tmp_path / "tokens").write_text(TOKENS)
    with ServiceProcess(tmp_path / "data", env={"REPLAY_TOKENS_FILE": str(tmp_path / "tokens")}) as proc:
        assert calls.post(f"{proc.url}/v1/ingest", content=rows("web-run", "seed", 4),
                          headers={**ARROW, **bearer(WRITE)}, timeout=30).status_code == 200
        with browser() as b:
            page, watch = new_page(b, proc.url)
            page.goto(f"{proc.url}/#/")
            form = page.locator("#token-form")
            form.wait_for()
            assert page.locator("#main").is_hidden()  # the page waits below the form
            field = page.get_by_label("Read token")
            assert field.get_attribute("type") == "password"
            assert page.locator("#token-error").is_hidden() and page.locator("#session").is_hidden()
            # a token the service does not know: refused, said so, the form stays, nothing kept
            field.fill("x" * 24)
            page.click("#token-submit")
            page.locator("#token-error").wait_for()
            assert "refused" in page.inner_text("#token-error")
            _shot(page, tmp_path, "signin-refused")
            assert form.is_visible() and page.evaluate(f"() => sessionStorage.getItem({json.dumps(TOKEN_KEY)})") is None
            # the read token: the runs page loads with it, the header offers sign-out
            field.fill(READ)
            page.click("#token-submit")
            page.wait_for_function("() => document.body.dataset.ready === '1'")
            assert page.locator("tr[data-run='web-run']").is_visible() and form.count() == 0
            assert page.evaluate(f"() => sessionStorage.getItem({json.dumps(TOKEN_KEY)})") == READ
            assert page.locator("#sign-out").is_visible() and page.locator("#change-token").is_visible()
            _shot(page, tmp_path, "signin-signed-in")
            # another page in the same tab reads with the held token: no form
            set_hash(page, "/runs/web-run")
            assert "web-run" in page.inner_text("h1") and form.count() == 0
            # change token: the form again (cancellable), a wrong one refused, the old one still held
            page.click("#change-token")
            form.wait_for()
            page.get_by_label("Read token").fill("y" * 24)
            page.click("#token-submit")
            page.locator("#token-error").wait_for()
            page.click("#token-cancel")
            assert form.count() == 0 and page.locator("#main").is_visible()
            assert page.evaluate(f"() => sessionStorage.getItem({json.dumps(TOKEN_KEY)})") == READ
            # a held token the service stops knowing: the run page's two concurrent reads both get a 401 and
            # share one form (a second form would strand the first read: the page would never be ready)
            page.evaluate(f"() => sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps('z' * 24)})")
            page.evaluate("() => { document.body.dataset.ready = '0'; location.hash = '/runs/web-run?tab=compares'; }")
            page.locator("#token-error").wait_for()
            assert page.locator("#token-form").count() == 1 and page.locator("#session").is_hidden()
            page.get_by_label("Read token").fill(READ)
            page.click("#token-submit")
            page.wait_for_function("() => document.body.dataset.ready === '1'")
            assert page.locator("#no-compares").is_visible() and form.count() == 0
            # sign out: the token is dropped and the form returns
            page.click("#sign-out")
            form.wait_for()
            assert page.evaluate(f"() => sessionStorage.getItem({json.dumps(TOKEN_KEY)})") is None
            assert page.locator("#session").is_hidden() and page.locator("#token-error").is_hidden()
            page.get_by_label("Read token").fill(ADMIN)  # any known role reads
            page.click("#token-submit")
            page.wait_for_function("() => document.body.dataset.ready === '1' && !!document.querySelector('h1')")
            assert "web-run" in page.inner_text("h1")
            assert watch.dialogs == [], watch.dialogs  # never window.prompt / alert / confirm
            assert not [e for e in watch.errors if "pageerror" in e], watch.errors
            assert watch.foreign_urls() == []
            page.context.close()


def _shot(page, out: Path, name: str) -> None:
    """A screenshot in the test's tmp dir, copied to /tmp/health_shots/ for whoever reviews the view."""
    path = out / f"{name}.png"
    page.screenshot(path=str(path))
    shots = Path("/tmp/health_shots")
    shots.mkdir(exist_ok=True)
    shutil.copy(path, shots / path.name)


def test_the_images_serve_with_tokens():
    root = Path(__file__).resolve().parent.parent
    for name in ("Dockerfile", "docker-compose.yml"):
        text = (root / name).read_text()
        assert "REPLAY_TOKENS_FILE" in text and "--insecure" not in text, name
    assert "secrets:" in (root / "docker-compose.yml").read_text()
