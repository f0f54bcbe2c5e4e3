"""Deployment files: no Docker, Kubernetes or Grafana runs here, so these check what can be checked
without them: every file parses, every file a manifest mounts or generates from exists, names agree
across compose, Kubernetes, the provisioning and the collector, and generated files are current."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import yaml

from witcert.collector import tables
from witcert.collector.migrations import cluster_ddl
from witcert.dashboards import datasource, export

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
# The variables Grafana's datasource provisioning reads from its environment.
PROVISIONING_ENV = {"CLICKHOUSE_HOST", "CLICKHOUSE_DATABASE", "CLICKHOUSE_READER_USER", "CLICKHOUSE_READER_PASSWORD"}


def load(relative: str) -> dict:
    return yaml.safe_load((DEPLOY / relative).read_text())


def test_compose_mounts_existing_files_and_wires_the_services():
    compose = load("compose.yaml")
    services = compose["services"]
    assert {"clickhouse", "witcert-schema", "witcert-collector", "grafana", "otelcol"} <= set(services)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    grafana = services["grafana"]
    assert datasource.PLUGIN_ID in grafana["environment"]["GF_INSTALL_PLUGINS"]
    assert PROVISIONING_ENV <= set(grafana["environment"])
    assert services["otelcol"]["profiles"] == ["otelcol"]
    assert (
        services["witcert-collector"]["depends_on"]["witcert-schema"]["condition"] == "service_completed_successfully"
    )


def test_datasource_provisioning_reads_exactly_the_variables_compose_and_kubernetes_set():
    text = (DEPLOY / "grafana/provisioning/datasources/witcert-clickhouse.yaml").read_text()
    used = {word.lstrip("$") for word in text.split() if word.startswith("$")}
    assert used == PROVISIONING_ENV
    (deployment,) = [
        d for d in yaml.safe_load_all((DEPLOY / "kubernetes/grafana.yaml").read_text()) if d["kind"] == "Deployment"
    ]
    env = {item["name"] for item in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert PROVISIONING_ENV <= env


def test_otel_collector_writes_the_collectors_raw_tables():
    config = load("otelcol/config.yaml")
    exporter = config["exporters"]["clickhouse"]
    assert exporter["create_schema"] is False  # the schema is witcert's, created by its migrations
    names = {kind: table["name"] for kind, table in exporter["metrics_tables"].items()}
    assert names == {"sum": tables.SUM, "gauge": tables.GAUGE, "histogram": tables.HISTOGRAM}
    assert config["service"]["pipelines"]["metrics"]["exporters"] == ["clickhouse"]


def test_clickhouse_users_match_the_passwords_deployments_provide():
    root = ElementTree.parse(DEPLOY / "clickhouse/users.d/witcert.xml").getroot()
    assert root.findtext("profiles/witcert_reader/readonly") == "2"  # no writes; the plugin may set settings
    password_env = {user.tag: user.find("password").get("from_env") for user in root.find("users")}
    assert password_env == {"witcert": "CLICKHOUSE_WRITER_PASSWORD", "witcert_reader": "CLICKHOUSE_READER_PASSWORD"}
    compose_env = set(load("compose.yaml")["x-clickhouse-credentials"])
    secret = load("kubernetes/secret.example.yaml")
    assert set(password_env.values()) == compose_env == set(secret["stringData"])


def test_kustomization_resources_and_generated_config_maps_exist():
    kustomization = load("kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (DEPLOY / resource).is_file(), resource
    generated = set()
    for generator in kustomization["configMapGenerator"]:
        generated.add(generator["name"])
        for file in generator["files"]:
            assert (DEPLOY / file).is_file(), file
    referenced = set()
    for resource in kustomization["resources"]:
        for document in yaml.safe_load_all((DEPLOY / resource).read_text()):
            spec = document.get("spec", {}).get("template", {}).get("spec", {})
            referenced |= {v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v}
    assert referenced == generated
    # Every provisioning file the exporter writes is shipped to Kubernetes.
    assert {f for g in kustomization["configMapGenerator"] for f in g["files"] if f.startswith("grafana/")} == {
        f"grafana/{relative}" for relative in export.provisioning_files()
    }


def test_cluster_ddl_is_the_collectors_output():
    assert (DEPLOY / "clickhouse/cluster.sql").read_text() == cluster_ddl("witcert", "default"), (
        "deploy/clickhouse/cluster.sql is stale: witcert schema --cluster witcert --database default "
        "> deploy/clickhouse/cluster.sql"
    )
