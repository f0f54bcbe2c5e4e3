"""Shows: the certificate panels and alerts, for Grafana and on a built-in page.

- ``panels``: every panel's SQL, written once; ``grafana`` builds the Grafana dashboard from it
  (grafana-foundation-sdk) and ``page`` the read-only page the collector serves (``witcert dashboards serve``);
  ``report`` writes that page, data embedded, as one self-contained HTML file (``witcert report``).
- ``alerts``: alert rules, contact point and notification policy as code.
- ``export`` and ``push``: the Grafana provisioning tree on disk (``witcert dashboards export DIR``) or pushed to
  a Grafana server (``witcert dashboards push --grafana URL``); ``datasource`` and ``macros`` are the
  grafana-clickhouse-datasource as the panels see it; ``cli`` registers ``witcert dashboards`` and ``witcert report``.

docs/DASHBOARDS.md describes them.
"""
