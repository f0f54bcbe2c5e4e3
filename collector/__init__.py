"""Receives, stores, queries: the OTLP collector and its ClickHouse (or embedded chDB) store.

- ``Collector`` and ``CollectorConfig`` (``service``, ``config``): the process, ``witcert collector``; OTLP/HTTP
  (aiohttp) and OTLP/gRPC receivers (``http_server``, ``grpc_server``) in front of the ingest ``pipeline``:
  bodies held against a memory ``budget``, large requests cut into pieces (``wire``), validated (``otlp``),
  acknowledged once fsync'd in the ``spool``, drained record by record into the ``store`` under content labels;
  what the store refuses for good goes to the spool's dead letters (``witcert dead-letter``).
- ``requests``: the request and answer types receivers, the read API and mounted pages share.
- ``tables`` names every table and view once; ``migrations`` creates them (``collector/schema/*.sql``).
- ``Queries`` (``queries``): every read of the store, used by ``witcert query``, the read-only HTTP API
  (``api``) and the dashboards' built-in page.
- ``loadgen``: prebuilt requests and a keep-alive OTLP/HTTP client (benchmark and tests).

docs/COLLECTOR.md and docs/STORAGE.md describe them.
"""
