"""Connects and emits: engine integrations and the engine-side telemetry.

- ``witcert.integrations.telemetry``: the certificate aggregator, the step report, the OTLP stream and
  the OTLP contract (``telemetry.schema``) shared with the collector.
- ``witcert.integrations.gating``: the gating policy (``CachePolicy``: off, observe or gate, tau, stride) and
  ``CertifiedDecode``, the certified decode step every engine runs (kernel, merge of repaired pairs, repair of
  heads above tau, step report); an engine adds only its paging and its exact K/V backup.
- ``witcert.integrations.transformers_cache``: a transformers ``Cache`` decoding through witcert.
- ``witcert.integrations.sglang``: the SGLang plugin (attention backend, int8 KV pool, capacity hook).
- ``witcert.integrations.quality``: the teacher-forced quality harness.
"""
