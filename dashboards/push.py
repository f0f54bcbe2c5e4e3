"""Push the datasource, folder, dashboard, alert rules, contact point and notification policy to a
running Grafana (grafana-client).

Every step reads first and then creates or updates by fixed uid, so pushing twice leaves Grafana
as pushing once did. Failures that an operator can fix (unreachable, rejected credentials, missing
permission, Grafana too old, ClickHouse plugin not installed) become a ``PushError`` with the fix.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError
from niquests.exceptions import RequestException  # grafana-client's HTTP layer: network failures

from .alerts import (
    CONTACT_POINT,
    DEFAULT_RECEIVERS,
    EVALUATION_INTERVAL_S,
    RULE_GROUP,
    alert_rules,
    alert_specs,
    contact_points,
    notification_policy,
)
from .datasource import DATASOURCE_UID, PLUGIN_ID
from .export import ClickHouseConnection, datasource_payload
from .grafana import FOLDER_TITLE, FOLDER_UID, dashboard_json

# The dashboards are built on the Grafana 11.6 schema; older servers misread parts of it.
MINIMUM_GRAFANA = (11, 6)


class PushError(RuntimeError):
    """Grafana refused or cannot take the push; the message says what to change."""


@dataclass
class PushReport:
    """What the push did, per kind of object: created or updated."""

    grafana_version: str
    actions: Counter[str] = field(default_factory=Counter)

    def record(self, kind: str, created: bool) -> None:
        self.actions[f"{kind} {'created' if created else 'updated'}"] += 1

    def summary(self) -> str:
        done = ", ".join(f"{count} {action}" for action, count in sorted(self.actions.items()))
        return f"Grafana {self.grafana_version}: {done}"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("-")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _exists(fetch: Any, *args: Any) -> bool:
    try:
        fetch(*args)
    except GrafanaClientError as error:
        if error.status_code == 404:
            return False
        raise
    return True


def _check_server(api: GrafanaApi, url: str) -> str:
    try:
        build_info = api.health.check()  # /api/frontend/settings: buildInfo, no login needed
    except GrafanaClientError as error:
        raise PushError(f"{url} does not answer like Grafana ({error.message}): is it a Grafana server?") from error
    except (GrafanaException, RequestException) as error:
        raise PushError(f"cannot reach Grafana at {url}: {error}") from error
    version = str(build_info.get("version", "")) if isinstance(build_info, dict) else ""
    if not version:
        raise PushError(f"{url} reported no Grafana version: is it a Grafana server?")
    if _version_tuple(version)[:2] < MINIMUM_GRAFANA:
        needed = ".".join(map(str, MINIMUM_GRAFANA))
        raise PushError(
            f"Grafana {version} at {url} is older than {needed}: the dashboards use the Grafana {needed} "
            f"schema (grafana-foundation-sdk 11.6); upgrade Grafana or provision an older export by hand"
        )
    return version


def _check_plugin(api: GrafanaApi) -> None:
    if not _exists(api.client.GET, f"/plugins/{PLUGIN_ID}/settings"):
        raise PushError(
            f"the {PLUGIN_ID} plugin is not installed in this Grafana: install it "
            f"(grafana cli plugins install {PLUGIN_ID}, or GF_INSTALL_PLUGINS={PLUGIN_ID}) and push again"
        )


def _push_all(
    api: GrafanaApi,
    report: PushReport,
    connection: ClickHouseConnection,
    rules: list[dict[str, Any]],
    points: list[dict[str, Any]],
) -> None:
    payload = datasource_payload(connection)
    if _exists(api.datasource.get_datasource_by_uid, DATASOURCE_UID):
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, payload)
        report.record("datasource", created=False)
    else:
        api.datasource.create_datasource(payload)
        report.record("datasource", created=True)

    if _exists(api.folder.get_folder, FOLDER_UID):
        api.folder.update_folder(FOLDER_UID, title=FOLDER_TITLE, overwrite=True)
        report.record("folder", created=False)
    else:
        api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        report.record("folder", created=True)

    dashboard = dashboard_json()
    existed = _exists(api.dashboard.get_dashboard, dashboard["uid"])
    api.dashboard.update_dashboard(
        {"dashboard": dashboard, "folderUid": FOLDER_UID, "overwrite": True, "message": "witcert dashboards push"}
    )
    report.record("dashboard", created=not existed)

    for rule in rules:
        if _exists(api.alertingprovisioning.get_alertrule, rule["uid"]):
            api.alertingprovisioning.update_alertrule(rule["uid"], rule)
            report.record("alert rule", created=False)
        else:
            api.alertingprovisioning.create_alertrule(rule)
            report.record("alert rule", created=True)
    # Rules created one by one land in a group with Grafana's default interval; set ours.
    api.alertingprovisioning.update_rule_group(
        FOLDER_UID,
        RULE_GROUP,
        {"title": RULE_GROUP, "folderUid": FOLDER_UID, "interval": EVALUATION_INTERVAL_S, "rules": rules},
    )

    existing = {point.get("uid") for point in api.alertingprovisioning.get_contactpoints(name=CONTACT_POINT)}
    for point in points:
        if point["uid"] in existing:
            api.alertingprovisioning.update_contactpoint(point["uid"], point)
            report.record("contact point", created=False)
        else:
            api.alertingprovisioning.create_contactpoint(point)
            report.record("contact point", created=True)
    api.alertingprovisioning.set_notification_policy_tree(notification_policy())
    report.record("notification policy", created=False)


def push(
    url: str,
    connection: ClickHouseConnection,
    credential: str | tuple[str, str] | None = None,
    timeout_s: float = 10.0,
    receivers: Sequence[str] = DEFAULT_RECEIVERS,
    environ: Mapping[str, str] | None = None,
    **alert_thresholds: Any,
) -> PushReport:
    """Create or update everything witcert needs in the Grafana at ``url``.

    ``credential``: an API token, or (user, password); without it, user:password from the URL.
    ``receivers``: the contact point's kinds; their destinations come from ``environ`` (default: this
    process's environment), e.g. ``WITCERT_ALERT_WEBHOOK_URL``.
    """
    scheme = urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise PushError(
            f"--grafana {url!r} has no http:// or https:// scheme: write it as http://{url.split('://')[-1]}"
        )
    points = contact_points(receivers, os.environ if environ is None else environ)
    rules = alert_rules(alert_specs(**alert_thresholds))
    api = GrafanaApi.from_url(url, credential=credential, timeout=timeout_s)
    report = PushReport(grafana_version=_check_server(api, url))
    try:
        _check_plugin(api)
        _push_all(api, report, connection, rules, points)
    except GrafanaUnauthorizedError as error:
        raise PushError(
            f"Grafana at {url} rejected the credentials (401): pass --token, or user:password in the URL"
        ) from error
    except GrafanaClientError as error:
        if error.status_code == 403:
            raise PushError(
                f"the credentials lack permission at {url} (403): datasources and alert rules need an Admin "
                f"(or a service account with the Admin role): {error.message}"
            ) from error
        raise PushError(f"Grafana at {url} refused the push: {error.message}") from error
    except (GrafanaException, RequestException) as error:
        raise PushError(f"Grafana at {url} failed during the push: {error}") from error
    return report
