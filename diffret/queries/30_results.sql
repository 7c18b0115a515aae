-- view: runs
-- files: runs/system=*/dataset=*/split=*/kq=*/kp=*/mode=*/run.parquet
-- One row per retrieved document. BM25 has kq = kp = 0 and mode = 'bm25'.
CREATE OR REPLACE VIEW runs AS
SELECT system, dataset, split, kq, kp, mode, query_id, doc_id, rank, score
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'system': VARCHAR, 'dataset': VARCHAR, 'split': VARCHAR,
                                'kq': INTEGER, 'kp': INTEGER, 'mode': VARCHAR});

-- view: metrics
-- files: metrics/system=*/dataset=*/split=*/kq=*/kp=*/mode=*/per_query.parquet
-- Per-query scores (pytrec_eval): ndcg_cut_10, mrr_10 (run cut at 10), recall_100, recall_1000.
CREATE OR REPLACE VIEW metrics AS
SELECT system, dataset, split, kq, kp, mode, query_id, measure, value
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'system': VARCHAR, 'dataset': VARCHAR, 'split': VARCHAR,
                                'kq': INTEGER, 'kp': INTEGER, 'mode': VARCHAR});

-- view: metric_means
-- One row per (system, dataset, split, cell, measure): the mean over the split's judged queries.
CREATE OR REPLACE VIEW metric_means AS
SELECT system, dataset, split, kq, kp, mode, measure, avg(value) AS mean, count(*) AS queries
FROM metrics
GROUP BY ALL;

-- view: cells
-- The grid wide: one row per (system, dataset, split, K_q, K_p, mode) with the mean of each headline
-- measure (storage/layout.py MEASURES: ndcg_10, mrr_10, recall_100, recall_1000) and the query count.
CREATE OR REPLACE VIEW cells AS
SELECT system, dataset, split, kq, kp, mode,
       @measure_columns,
       count(DISTINCT query_id) AS queries
FROM metrics
GROUP BY ALL;

-- view: best_cells
-- Best (K_q, K_p) per (system, dataset, split, mode) by mean ndcg_cut_10 (ties: the smaller budget).
CREATE OR REPLACE VIEW best_cells AS
SELECT *
FROM cells
QUALIFY row_number() OVER (PARTITION BY system, dataset, split, mode ORDER BY ndcg_10 DESC, kq + kp, kq) = 1;

-- view: late_runs
-- One row per late-parametric run (diffret late): what it re-scored, and what it cost in encoded passages.
CREATE OR REPLACE VIEW late_runs AS
SELECT partition ->> 'system' AS system, partition ->> 'dataset' AS dataset, partition ->> 'split' AS split,
       CAST(partition ->> 'kq' AS INTEGER) AS kq, CAST(partition ->> 'kp' AS INTEGER) AS kp,
       partition ->> 'mode' AS mode, config ->> 'rescore' AS rescore, CAST(config ->> 'topk' AS INTEGER) AS m,
       config -> 'first_stage' ->> 'system' AS first_system, config -> 'first_stage' ->> 'mode' AS first_mode,
       CAST(config -> 'first_stage' ->> 'kq' AS INTEGER) AS first_kq,
       CAST(config -> 'first_stage' ->> 'kp' AS INTEGER) AS first_kp,
       CAST(stats ->> 'needed_m' AS BIGINT) AS passages_needed, CAST(stats ->> 'encoded' AS BIGINT) AS encoded_by_run,
       CAST(stats ->> 'corpus' AS BIGINT) AS corpus, CAST(stats ->> 'encode_seconds' AS DOUBLE) AS encode_seconds
FROM manifests WHERE stage = 'runs' AND config ->> 'rescore' IS NOT NULL;

-- view: search_costs
-- One row per run whose search was timed (score, beta, late): the wall seconds of the pass that wrote it over the
-- queries it searched (every split's at once), in a batch: throughput per query, not one query's latency. A score
-- pass writes several cells at once (pass_cells share its time); a late run's time is its re-scoring alone.
CREATE OR REPLACE VIEW search_costs AS
SELECT partition ->> 'system' AS system, partition ->> 'dataset' AS dataset, partition ->> 'split' AS split,
       CAST(partition ->> 'kq' AS INTEGER) AS kq, CAST(partition ->> 'kp' AS INTEGER) AS kp,
       partition ->> 'mode' AS mode, CAST(stats ->> 'search_seconds' AS DOUBLE) AS search_seconds,
       CAST(stats ->> 'searched_queries' AS BIGINT) AS searched_queries, CAST(stats ->> 'pass_cells' AS INTEGER) AS pass_cells,
       1000 * CAST(stats ->> 'search_seconds' AS DOUBLE) / NULLIF(CAST(stats ->> 'searched_queries' AS BIGINT), 0)
           AS ms_per_query, CAST(stats ->> 'index_seconds' AS DOUBLE) AS index_seconds
FROM manifests WHERE stage = 'runs' AND stats ->> 'search_seconds' IS NOT NULL;

-- view: late_costs
-- What each late-parametric pipeline costs per query, from measured times (ms per query in a batch, query
-- encoding excluded: the same encoder in every pipeline): its first stage's search, its re-scoring, and passage
-- encoding at the rate the system's late runs measured. on_the_fly_ms_per_query is SIDR's official way (the m
-- passages encoded for each query); the full pipeline instead encodes the whole corpus once
-- (full_index_encode_seconds) and searches it (full_ms_per_query).
CREATE OR REPLACE VIEW late_costs AS
WITH rate AS (
    SELECT system, dataset, sum(encode_seconds) / sum(encoded_by_run) AS encode_s_per_passage
    FROM late_runs WHERE encoded_by_run > 0 AND encode_seconds IS NOT NULL GROUP BY system, dataset
)
SELECT l.system, l.dataset, l.split, l.rescore, l.m, l.first_system, l.first_mode,
       f.ms_per_query AS first_ms_per_query, s.ms_per_query AS rescore_ms_per_query,
       1000 * r.encode_s_per_passage AS encode_ms_per_passage,
       f.ms_per_query + s.ms_per_query + l.m * 1000 * r.encode_s_per_passage AS on_the_fly_ms_per_query,
       full_run.ms_per_query AS full_ms_per_query, l.corpus * r.encode_s_per_passage AS full_index_encode_seconds,
       l.passages_needed, l.corpus
FROM late_runs AS l
LEFT JOIN search_costs AS s ON s.system = l.system AND s.dataset = l.dataset AND s.split = l.split
                           AND s.kq = l.kq AND s.kp = l.kp AND s.mode = l.mode
LEFT JOIN search_costs AS f ON f.system = l.first_system AND f.dataset = l.dataset AND f.split = l.split
                           AND f.kq = l.first_kq AND f.kp = l.first_kp AND f.mode = l.first_mode
LEFT JOIN search_costs AS full_run ON full_run.system = l.system AND full_run.dataset = l.dataset
                                  AND full_run.split = l.split AND full_run.kq = l.kq AND full_run.kp = l.kp
                                  AND full_run.mode = l.rescore
LEFT JOIN rate AS r ON r.system = l.system AND r.dataset = l.dataset;

-- view: late_gains
-- One row per late run with NDCG@10 beside its first stage's, the full-corpus run of the same mode (when scored)
-- and BM25's, on the same dataset and split: SIDR's full / beta / beta(m) against BM25, for any system.
CREATE OR REPLACE VIEW late_gains AS
SELECT l.system, l.dataset, l.split, l.rescore, l.kq, l.kp, l.m, l.first_system, l.first_mode,
       c.ndcg_10, f.ndcg_10 AS first_ndcg_10, full_run.ndcg_10 AS full_ndcg_10, b.ndcg_10 AS bm25_ndcg_10,
       l.passages_needed, l.corpus, c.queries
FROM late_runs AS l
JOIN cells AS c ON c.system = l.system AND c.dataset = l.dataset AND c.split = l.split AND c.kq = l.kq
               AND c.kp = l.kp AND c.mode = l.mode
LEFT JOIN cells AS f ON f.system = l.first_system AND f.dataset = l.dataset AND f.split = l.split
                    AND f.kq = l.first_kq AND f.kp = l.first_kp AND f.mode = l.first_mode
LEFT JOIN cells AS full_run ON full_run.system = l.system AND full_run.dataset = l.dataset
                           AND full_run.split = l.split AND full_run.kq = l.kq AND full_run.kp = l.kp
                           AND full_run.mode = l.rescore
LEFT JOIN cells AS b ON b.mode = 'bm25' AND b.dataset = l.dataset AND b.split = l.split;
