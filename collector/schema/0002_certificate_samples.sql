-- Typed certificate samples: one row per sampled (layer, head, step), read from the raw gauge table.
-- +inf is a valid (overflowed) bound and is kept as it is. Rows whose layer/head/step attributes
-- are not unsigned integers stay raw only (another writer, e.g. the contrib exporter, may send them).

CREATE TABLE IF NOT EXISTS ${T_CERTIFICATE_SAMPLES} ${ON_CLUSTER} (
    Timestamp DateTime64(9, 'UTC') CODEC(Delta, ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    Instance LowCardinality(String) CODEC(ZSTD(1)),
    Model LowCardinality(String) CODEC(ZSTD(1)),
    Engine LowCardinality(String) CODEC(ZSTD(1)),
    TpRank UInt16 CODEC(ZSTD(1)),
    Layer UInt16 CODEC(ZSTD(1)),
    Head UInt16 CODEC(ZSTD(1)),
    Step UInt64 CODEC(Delta, ZSTD(1)),
    Value Float64 CODEC(ZSTD(1))
) ENGINE = ${MERGE_TREE}
TTL toDateTime(Timestamp) + toIntervalDay(${SAMPLES_TTL_DAYS})
PARTITION BY toDate(Timestamp)
ORDER BY (Model, Instance, TpRank, Layer, Head, Timestamp, Step)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1${DEDUP};

CREATE MATERIALIZED VIEW IF NOT EXISTS ${T_CERTIFICATE_SAMPLES_MV} ${ON_CLUSTER}
TO ${T_CERTIFICATE_SAMPLES} AS
SELECT
    TimeUnix AS Timestamp,
    ServiceName,
    ResourceAttributes['${R_INSTANCE}'] AS Instance,
    ResourceAttributes['${R_MODEL}'] AS Model,
    ResourceAttributes['${R_ENGINE}'] AS Engine,
    toUInt16OrZero(ResourceAttributes['${R_TP_RANK}']) AS TpRank,
    toUInt16(toUInt16OrNull(Attributes['${A_LAYER}'])) AS Layer,
    toUInt16(toUInt16OrNull(Attributes['${A_HEAD}'])) AS Head,
    toUInt64(toUInt64OrNull(Attributes['${A_STEP}'])) AS Step,
    Value
FROM ${T_GAUGE}
WHERE MetricName = '${M_SAMPLE}'
    AND isNotNull(toUInt16OrNull(Attributes['${A_LAYER}']))
    AND isNotNull(toUInt16OrNull(Attributes['${A_HEAD}']))
    AND isNotNull(toUInt64OrNull(Attributes['${A_STEP}']));
