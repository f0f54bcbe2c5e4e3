"""`witcert dashboards push` through the real grafana-client over HTTP.

No Grafana server can be installed here (no registry carries one), so the far end is a small
stand-in that keeps objects in memory and answers the endpoints push uses with Grafana's status
codes and shapes (build info, plugin settings, datasources, folders, dashboards, alert-rule,
rule-group, contact-point and notification-policy provisioning; basic and bearer auth; viewer role).
It is a test double for an absent component, not a mock of our code: what is tested is our push
logic and grafana-client together.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from witcert.dashboards import alerts, grafana
from witcert.dashboards.datasource import DATASOURCE_UID, PLUGIN_ID
from witcert.dashboards.export import ClickHouseConnection
from witcert.dashboards.push import PushError, push

ADMIN = ("admin", "secret")
VIEWER_TOKEN = "viewer-token"
CONNECTION = ClickHouseConnection(host="clickhouse", database="default", username="witcert_reader", password="pw")
DESTINATIONS = {"WITCERT_ALERT_WEBHOOK_URL": "https://hooks.example/witcert", "WITCERT_ALERT_EMAIL_ADDRESSES": "a@b.c"}


@pytest.fixture(autouse=True)
def alert_destinations(monkeypatch: pytest.MonkeyPatch):
    for name, value in DESTINATIONS.items():
        monkeypatch.setenv(name, value)


class FakeGrafana(ThreadingHTTPServer):
    def __init__(self, version: str = "11.6.0", plugin_installed: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.version = version
        self.plugin_installed = plugin_installed
        self.objects: dict[str, dict[str, dict]] = {
            "datasource": {},
            "folder": {},
            "dashboard": {},
            "rule": {},
            "group": {},
            "contact point": {},
            "policy": {},
        }
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _role(self) -> str | None:
        header = self.headers.get("Authorization", "")
        if header == "Basic " + base64.b64encode(":".join(ADMIN).encode()).decode():
            return "Admin"
        if header == f"Bearer {VIEWER_TOKEN}":
            return "Viewer"
        return None

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def _handle(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/api/frontend/settings":  # served to anonymous users too (the login page needs it)
            return self._reply(200, {"buildInfo": {"version": self.server.version, "edition": "Open Source"}})
        role = self._role()
        if role is None:
            return self._reply(401, {"message": "Unauthorized"})
        if self.command != "GET" and role != "Admin":
            return self._reply(403, {"message": "You'll need additional permissions to perform this action."})
        body = self._body() if self.command in ("POST", "PUT") else {}
        objects = self.server.objects
        with self.server.lock:
            if path == f"/api/plugins/{PLUGIN_ID}/settings":
                return self._reply(200 if self.server.plugin_installed else 404, {"id": PLUGIN_ID})
            routes = [
                (r"/api/datasources/uid/([\w-]+)", "datasource"),
                (r"/api/folders/([\w-]+)", "folder"),
                (r"/api/dashboards/uid/([\w-]+)", "dashboard"),
                (r"/api/v1/provisioning/alert-rules/([\w-]+)", "rule"),
            ]
            for pattern, kind in routes:
                match = re.fullmatch(pattern, path)
                if match:
                    uid = match.group(1)
                    if uid not in objects[kind]:
                        return self._reply(404, {"message": f"{kind} not found"})
                    if self.command == "GET":
                        return self._reply(200, objects[kind][uid])
                    if self.command == "PUT":
                        if kind == "rule" and not _valid_rule(body):
                            return self._reply(400, {"message": "invalid alert rule"})
                        objects[kind][uid] = (
                            body if kind != "folder" else {**objects[kind][uid], "title": body["title"]}
                        )
                        return self._reply(200, objects[kind][uid])
            creations = {
                "/api/datasources": "datasource",
                "/api/folders": "folder",
                "/api/v1/provisioning/alert-rules": "rule",
            }
            if self.command == "POST" and path in creations:
                kind = creations[path]
                if kind == "rule" and not _valid_rule(body):
                    return self._reply(400, {"message": "invalid alert rule"})
                if body["uid"] in objects[kind]:
                    return self._reply(409, {"message": f"{kind} with uid {body['uid']} already exists"})
                objects[kind][body["uid"]] = body
                return self._reply(201 if kind == "rule" else 200, body)
            if self.command == "POST" and path == "/api/dashboards/db":
                dashboard = body["dashboard"]
                if dashboard["uid"] in objects["dashboard"] and not body.get("overwrite"):
                    return self._reply(412, {"message": "A dashboard with the same uid already exists"})
                if body.get("folderUid") not in objects["folder"]:
                    return self._reply(400, {"message": "folder not found"})
                objects["dashboard"][dashboard["uid"]] = {
                    "dashboard": dashboard,
                    "meta": {"folderUid": body["folderUid"]},
                }
                return self._reply(200, {"uid": dashboard["uid"], "status": "success"})
            if path == "/api/v1/provisioning/contact-points":
                if self.command == "GET":
                    return self._reply(200, list(objects["contact point"].values()))
                if self.command == "POST":
                    if not {"uid", "name", "type", "settings"} <= set(body):
                        return self._reply(400, {"message": "invalid contact point"})
                    objects["contact point"][body["uid"]] = body
                    return self._reply(202, body)
            match = re.fullmatch(r"/api/v1/provisioning/contact-points/([\w-]+)", path)
            if match and self.command == "PUT":
                if match.group(1) not in objects["contact point"]:
                    return self._reply(404, {"message": "contact point not found"})
                objects["contact point"][match.group(1)] = body
                return self._reply(202, body)
            if path == "/api/v1/provisioning/policies" and self.command == "PUT":
                receivers = {point["name"] for point in objects["contact point"].values()}
                if body.get("receiver") not in receivers:
                    return self._reply(400, {"message": "policy names an unknown contact point"})
                objects["policy"]["tree"] = body
                return self._reply(202, {"message": "policies updated"})
            match = re.fullmatch(r"/api/v1/provisioning/folder/([\w-]+)/rule-groups/([\w-]+)", path)
            if match and self.command == "PUT":
                if not all(rule["uid"] in objects["rule"] and _valid_rule(rule) for rule in body["rules"]):
                    return self._reply(400, {"message": "rule group refers to unknown or invalid rules"})
                objects["group"][f"{match.group(1)}/{match.group(2)}"] = body
                return self._reply(200, body)
        return self._reply(404, {"message": f"no route {self.command} {path}"})

    do_GET = do_POST = do_PUT = _handle


def _valid_rule(rule: dict) -> bool:
    required = {"uid", "title", "condition", "data", "folderUID", "ruleGroup", "for", "noDataState", "execErrState"}
    return required <= set(rule) and rule["condition"] in {query["refId"] for query in rule["data"]}


@pytest.fixture
def fake_grafana():
    servers: list[FakeGrafana] = []

    def start(**options: object) -> FakeGrafana:
        server = FakeGrafana(**options)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_push_creates_everything_then_updates_in_place(fake_grafana):
    server = fake_grafana()
    first = push(server.url, CONNECTION, credential=ADMIN, receivers=("webhook", "email"))
    assert first.actions == {
        "datasource created": 1, "folder created": 1, "dashboard created": 1, "alert rule created": 4,
        "contact point created": 2, "notification policy updated": 1,
    }  # fmt: skip
    after_first = copy.deepcopy(server.objects)
    second = push(server.url, CONNECTION, credential=ADMIN, receivers=("webhook", "email"))
    assert second.actions == {
        "datasource updated": 1, "folder updated": 1, "dashboard updated": 1, "alert rule updated": 4,
        "contact point updated": 2, "notification policy updated": 1,
    }  # fmt: skip
    assert server.objects == after_first  # idempotent: the second push changed nothing
    stored = server.objects
    assert stored["datasource"][DATASOURCE_UID]["secureJsonData"] == {"password": "pw"}
    assert stored["dashboard"][grafana.DASHBOARD_UID]["dashboard"] == grafana.dashboard_json()
    assert set(stored["rule"]) == {spec.uid for spec in alerts.alert_specs()}
    assert stored["group"][f"{grafana.FOLDER_UID}/{alerts.RULE_GROUP}"]["interval"] == alerts.EVALUATION_INTERVAL_S
    destinations = {uid: point["settings"] for uid, point in stored["contact point"].items()}
    assert destinations["witcert-webhook"]["url"] == DESTINATIONS["WITCERT_ALERT_WEBHOOK_URL"]
    assert destinations["witcert-email"]["addresses"] == DESTINATIONS["WITCERT_ALERT_EMAIL_ADDRESSES"]
    assert stored["policy"]["tree"] == alerts.notification_policy()


def test_push_needs_each_receivers_destination(fake_grafana, monkeypatch: pytest.MonkeyPatch):
    server = fake_grafana()
    monkeypatch.delenv("WITCERT_ALERT_WEBHOOK_URL")
    with pytest.raises(ValueError, match="WITCERT_ALERT_WEBHOOK_URL"):
        push(server.url, CONNECTION, credential=ADMIN)
    assert server.objects["datasource"] == {}  # refused before anything was written


def test_a_grafana_url_without_a_scheme_is_refused_with_the_fix():
    with pytest.raises(PushError, match="write it as http://grafana:3000"):
        push("grafana:3000", CONNECTION, credential=ADMIN)


def test_push_carries_alert_thresholds(fake_grafana):
    server = fake_grafana()
    push(server.url, CONNECTION, credential=ADMIN, coverage_target=0.9)
    threshold = server.objects["rule"]["witcert-coverage-low"]["data"][1]["model"]["conditions"][0]["evaluator"]
    assert threshold == {"params": [0.9], "type": "lt"}


@pytest.mark.parametrize(
    ("options", "credential", "message"),
    [
        ({}, ("admin", "wrong"), "rejected the credentials (401)"),
        ({}, VIEWER_TOKEN, "lack permission"),
        ({"version": "10.4.1"}, ADMIN, "Grafana 10.4.1 at"),
        ({"plugin_installed": False}, ADMIN, f"{PLUGIN_ID} plugin is not installed"),
    ],
)
def test_push_errors_say_what_to_fix(fake_grafana, options, credential, message):
    server = fake_grafana(**options)
    with pytest.raises(PushError, match=re.escape(message)):
        push(server.url, CONNECTION, credential=credential)
    assert server.objects["rule"] == {}  # nothing half-pushed past the failing step's first write


def test_push_to_nothing_says_it_cannot_reach_grafana():
    with pytest.raises(PushError, match="cannot reach Grafana"):
        push("http://127.0.0.1:9", CONNECTION, credential=ADMIN, timeout_s=2)


def test_cli_push_reads_credentials_from_the_url(fake_grafana, capsys):
    import argparse

    from witcert.dashboards import cli

    server = fake_grafana()
    parser = argparse.ArgumentParser(prog="witcert")
    cli.register(parser.add_subparsers())
    url = server.url.replace("http://", "http://admin:secret@")
    args = parser.parse_args(["dashboards", "push", "--grafana", url])
    assert args.handler(args) == 0
    assert "4 alert rule created" in capsys.readouterr().out
    args = parser.parse_args(["dashboards", "push", "--grafana", server.url.replace("http://", "http://admin:no@")])
    assert args.handler(args) == 1
    assert "401" in capsys.readouterr().err
