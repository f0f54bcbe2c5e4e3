"""Receives, stores, queries: the OTLP collector and its ClickHouse (or embedded chDB) store.

- ``Collector`` and ``CollectorConfig`` (``service``, ``config``): the process, ``witcert collector``; OTLP/HTTP
  and OTLP/gRPC receivers (``http_server``, ``grpc_server``) in front of the ingest ``pipeline``: validate
  (``otlp``), acknowledge once fsync'd in the ``spool``, drain in batches into the ``store``.
- ``tables`` names every table and view once; ``migrations`` creates them (``collector/schema/*.sql``).
- ``Queries`` (``queries``): every read of the store, used by ``witcert query``, the read-only HTTP API
  (``api``) and the dashboards' built-in page.

docs/COLLECTOR.md and docs/STORAGE.md describe them.
"""
