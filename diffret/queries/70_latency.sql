-- view: encode_latency
-- files: latency/system=*/kind=encode/setting=*/encode_latency.parquet
-- Encoding latency (diffret latency): milliseconds per text at a synthetic input length, batch size and budget K
-- (the cap N for PromptReps; slots: how many it decoded), min / median / max of repeated runs, with the machine
-- (device_name, threads, dtype, attention, library versions). setting: the hash of the settings and the machine.
CREATE OR REPLACE VIEW encode_latency AS
SELECT *
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'system': VARCHAR, 'kind': VARCHAR, 'setting': VARCHAR});

-- view: search_latency
-- files: latency/system=*/kind=search/setting=*/search_latency.parquet
-- Search latency (diffret latency): milliseconds per query over a synthetic index of `docs` documents, exact
-- search, single-vector (K_q = K_p = 1) or multi-vector, with the machine.
CREATE OR REPLACE VIEW search_latency AS
SELECT *
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'system': VARCHAR, 'kind': VARCHAR, 'setting': VARCHAR});

-- view: encode_latency_latest
-- encode_latency with one row per (system, side, length, batch size, K, machine): the newest measurement, so that
-- a system timed again with other repeats or warm-up is one point (what the report plots).
CREATE OR REPLACE VIEW encode_latency_latest AS
SELECT *
FROM encode_latency
QUALIFY row_number() OVER (PARTITION BY system, side, length, batch_size, k, device_name
                           ORDER BY measured_at DESC) = 1;

-- view: search_latency_latest
-- search_latency with one row per (system, engine, index type, mode, index size, K_q, K_p, width, queries, machine):
-- the newest measurement.
CREATE OR REPLACE VIEW search_latency_latest AS
SELECT *
FROM search_latency
QUALIFY row_number() OVER (PARTITION BY system, engine, index_type, mode, docs, kq, kp, hidden, queries, device_name
                           ORDER BY measured_at DESC) = 1;
