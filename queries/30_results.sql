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
