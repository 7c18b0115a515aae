-- view: runs
-- files: runs/model=*/dataset=*/split=*/kq=*/kp=*/mode=*/run.parquet
-- One row per retrieved document. BM25 has kq = kp = 0 and mode = 'bm25'.
CREATE OR REPLACE VIEW runs AS
SELECT model, dataset, split, kq, kp, mode, query_id, doc_id, rank, score
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'model': VARCHAR, 'dataset': VARCHAR, 'split': VARCHAR,
                                'kq': INTEGER, 'kp': INTEGER, 'mode': VARCHAR});

-- view: metrics
-- files: metrics/model=*/dataset=*/split=*/kq=*/kp=*/mode=*/per_query.parquet
-- Per-query scores (pytrec_eval): ndcg_cut_10, mrr_10 (run cut at 10), recall_100, recall_1000.
CREATE OR REPLACE VIEW metrics AS
SELECT model, dataset, split, kq, kp, mode, query_id, measure, value
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'model': VARCHAR, 'dataset': VARCHAR, 'split': VARCHAR,
                                'kq': INTEGER, 'kp': INTEGER, 'mode': VARCHAR});

-- view: metric_means
-- One row per (system, dataset, split, cell, measure): the mean over the split's judged queries.
CREATE OR REPLACE VIEW metric_means AS
SELECT model, dataset, split, kq, kp, mode, measure, avg(value) AS mean, count(*) AS queries
FROM metrics
GROUP BY ALL;

-- view: cells
-- The grid wide: one row per (system, dataset, split, K_q, K_p, mode) with the four headline measures.
CREATE OR REPLACE VIEW cells AS
SELECT model, dataset, split, kq, kp, mode,
       avg(value) FILTER (WHERE measure = 'ndcg_cut_10') AS ndcg_10,
       avg(value) FILTER (WHERE measure = 'mrr_10') AS mrr_10,
       avg(value) FILTER (WHERE measure = 'recall_100') AS recall_100,
       avg(value) FILTER (WHERE measure = 'recall_1000') AS recall_1000,
       count(DISTINCT query_id) AS queries
FROM metrics
GROUP BY ALL;

-- view: best_cells
-- Best (K_q, K_p) per (system, dataset, split, mode) by mean ndcg_cut_10 (ties: the smaller budget).
CREATE OR REPLACE VIEW best_cells AS
SELECT *
FROM cells
QUALIFY row_number() OVER (PARTITION BY model, dataset, split, mode ORDER BY ndcg_10 DESC, kq + kp, kq) = 1;
