-- 1-minute and 1-hour rollups of the delta counters and of the certificate-value histogram.
-- Counters without layer/head attributes (steps, dropped points) land on Layer = Head = 65535.
-- Only DELTA points (AggregationTemporality = 1) are summed: cumulative points stay raw only.
-- Bucket rows: UpperBound is the bucket's upper edge (+inf for the overflow bucket) and Count the
-- number of finite sampled certificates in (previous edge, UpperBound]; rows with Count = 0 are
-- dropped. Coverage at tau' is sum(Count | UpperBound <= tau') / sum(Count) (a lower bound between edges).

CREATE TABLE IF NOT EXISTS ${T_COUNTS_1M} ${ON_CLUSTER} (
    Bucket DateTime('UTC') CODEC(Delta, ZSTD(1)),
    Model LowCardinality(String),
    Instance LowCardinality(String),
    TpRank UInt16,
    Layer UInt16,
    Head UInt16,
    Certificates UInt64,
    Covered UInt64,
    Vacuous UInt64,
    Infinite UInt64,
    NaNs UInt64,
    Fallbacks UInt64,
    RepairedBytes UInt64,
    Steps UInt64,
    Dropped UInt64
) ENGINE = ${SUMMING_MERGE_TREE}
TTL Bucket + toIntervalDay(${ROLLUP_1M_TTL_DAYS})
PARTITION BY toDate(Bucket)
ORDER BY (Model, Instance, TpRank, Layer, Head, Bucket)
SETTINGS ttl_only_drop_parts = 1${DEDUP};

CREATE TABLE IF NOT EXISTS ${T_COUNTS_1H} ${ON_CLUSTER} AS ${T_COUNTS_1M}
ENGINE = ${SUMMING_MERGE_TREE}
TTL Bucket + toIntervalDay(${ROLLUP_1H_TTL_DAYS})
PARTITION BY toYYYYMM(Bucket)
ORDER BY (Model, Instance, TpRank, Layer, Head, Bucket)
SETTINGS ttl_only_drop_parts = 1${DEDUP};

CREATE TABLE IF NOT EXISTS ${T_BUCKETS_1M} ${ON_CLUSTER} (
    Bucket DateTime('UTC') CODEC(Delta, ZSTD(1)),
    Model LowCardinality(String),
    Instance LowCardinality(String),
    TpRank UInt16,
    Layer UInt16,
    Head UInt16,
    UpperBound Float64,
    Count UInt64
) ENGINE = ${SUMMING_MERGE_TREE}
TTL Bucket + toIntervalDay(${ROLLUP_1M_TTL_DAYS})
PARTITION BY toDate(Bucket)
ORDER BY (Model, Instance, TpRank, Layer, Head, Bucket, UpperBound)
SETTINGS ttl_only_drop_parts = 1${DEDUP};

CREATE TABLE IF NOT EXISTS ${T_BUCKETS_1H} ${ON_CLUSTER} AS ${T_BUCKETS_1M}
ENGINE = ${SUMMING_MERGE_TREE}
TTL Bucket + toIntervalDay(${ROLLUP_1H_TTL_DAYS})
PARTITION BY toYYYYMM(Bucket)
ORDER BY (Model, Instance, TpRank, Layer, Head, Bucket, UpperBound)
SETTINGS ttl_only_drop_parts = 1${DEDUP};

CREATE MATERIALIZED VIEW IF NOT EXISTS ${T_COUNTS_1M_MV} ${ON_CLUSTER} TO ${T_COUNTS_1M} AS
SELECT
    toStartOfMinute(TimeUnix) AS Bucket,
    ResourceAttributes['${R_MODEL}'] AS Model,
    ResourceAttributes['${R_INSTANCE}'] AS Instance,
    toUInt16OrZero(ResourceAttributes['${R_TP_RANK}']) AS TpRank,
    ifNull(toUInt16OrNull(Attributes['${A_LAYER}']), 65535) AS Layer,
    ifNull(toUInt16OrNull(Attributes['${A_HEAD}']), 65535) AS Head,
    toUInt64(sumIf(Value, MetricName = '${M_CERTIFICATES}')) AS Certificates,
    toUInt64(sumIf(Value, MetricName = '${M_COVERED}')) AS Covered,
    toUInt64(sumIf(Value, MetricName = '${M_VACUOUS}')) AS Vacuous,
    toUInt64(sumIf(Value, MetricName = '${M_INFINITE}')) AS Infinite,
    toUInt64(sumIf(Value, MetricName = '${M_NAN}')) AS NaNs,
    toUInt64(sumIf(Value, MetricName = '${M_FALLBACKS}')) AS Fallbacks,
    toUInt64(sumIf(Value, MetricName = '${M_REPAIRED_BYTES}')) AS RepairedBytes,
    toUInt64(sumIf(Value, MetricName = '${M_STEPS}')) AS Steps,
    toUInt64(sumIf(Value, MetricName = '${M_DROPPED}')) AS Dropped
FROM ${T_SUM}
WHERE MetricName IN (${M_COUNTERS}) AND AggregationTemporality = 1 AND isFinite(Value) AND Value >= 0
GROUP BY Bucket, Model, Instance, TpRank, Layer, Head;

CREATE MATERIALIZED VIEW IF NOT EXISTS ${T_COUNTS_1H_MV} ${ON_CLUSTER} TO ${T_COUNTS_1H} AS
SELECT
    toStartOfHour(TimeUnix) AS Bucket,
    ResourceAttributes['${R_MODEL}'] AS Model,
    ResourceAttributes['${R_INSTANCE}'] AS Instance,
    toUInt16OrZero(ResourceAttributes['${R_TP_RANK}']) AS TpRank,
    ifNull(toUInt16OrNull(Attributes['${A_LAYER}']), 65535) AS Layer,
    ifNull(toUInt16OrNull(Attributes['${A_HEAD}']), 65535) AS Head,
    toUInt64(sumIf(Value, MetricName = '${M_CERTIFICATES}')) AS Certificates,
    toUInt64(sumIf(Value, MetricName = '${M_COVERED}')) AS Covered,
    toUInt64(sumIf(Value, MetricName = '${M_VACUOUS}')) AS Vacuous,
    toUInt64(sumIf(Value, MetricName = '${M_INFINITE}')) AS Infinite,
    toUInt64(sumIf(Value, MetricName = '${M_NAN}')) AS NaNs,
    toUInt64(sumIf(Value, MetricName = '${M_FALLBACKS}')) AS Fallbacks,
    toUInt64(sumIf(Value, MetricName = '${M_REPAIRED_BYTES}')) AS RepairedBytes,
    toUInt64(sumIf(Value, MetricName = '${M_STEPS}')) AS Steps,
    toUInt64(sumIf(Value, MetricName = '${M_DROPPED}')) AS Dropped
FROM ${T_SUM}
WHERE MetricName IN (${M_COUNTERS}) AND AggregationTemporality = 1 AND isFinite(Value) AND Value >= 0
GROUP BY Bucket, Model, Instance, TpRank, Layer, Head;

CREATE MATERIALIZED VIEW IF NOT EXISTS ${T_BUCKETS_1M_MV} ${ON_CLUSTER} TO ${T_BUCKETS_1M} AS
SELECT
    toStartOfMinute(TimeUnix) AS Bucket,
    ResourceAttributes['${R_MODEL}'] AS Model,
    ResourceAttributes['${R_INSTANCE}'] AS Instance,
    toUInt16OrZero(ResourceAttributes['${R_TP_RANK}']) AS TpRank,
    ifNull(toUInt16OrNull(Attributes['${A_LAYER}']), 65535) AS Layer,
    ifNull(toUInt16OrNull(Attributes['${A_HEAD}']), 65535) AS Head,
    bucket.1 AS UpperBound,
    sum(bucket.2) AS Count
FROM ${T_HISTOGRAM}
ARRAY JOIN arrayZip(arrayPushBack(ExplicitBounds, inf), BucketCounts) AS bucket
WHERE MetricName = '${M_VALUE}' AND AggregationTemporality = 1
    AND length(BucketCounts) = length(ExplicitBounds) + 1
GROUP BY Bucket, Model, Instance, TpRank, Layer, Head, UpperBound
HAVING Count > 0;

CREATE MATERIALIZED VIEW IF NOT EXISTS ${T_BUCKETS_1H_MV} ${ON_CLUSTER} TO ${T_BUCKETS_1H} AS
SELECT
    toStartOfHour(TimeUnix) AS Bucket,
    ResourceAttributes['${R_MODEL}'] AS Model,
    ResourceAttributes['${R_INSTANCE}'] AS Instance,
    toUInt16OrZero(ResourceAttributes['${R_TP_RANK}']) AS TpRank,
    ifNull(toUInt16OrNull(Attributes['${A_LAYER}']), 65535) AS Layer,
    ifNull(toUInt16OrNull(Attributes['${A_HEAD}']), 65535) AS Head,
    bucket.1 AS UpperBound,
    sum(bucket.2) AS Count
FROM ${T_HISTOGRAM}
ARRAY JOIN arrayZip(arrayPushBack(ExplicitBounds, inf), BucketCounts) AS bucket
WHERE MetricName = '${M_VALUE}' AND AggregationTemporality = 1
    AND length(BucketCounts) = length(ExplicitBounds) + 1
GROUP BY Bucket, Model, Instance, TpRank, Layer, Head, UpperBound
HAVING Count > 0;
