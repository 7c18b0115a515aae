-- Analyses of the paper (sections 4.4 and 6), over the metrics of the grid. Conventions:
--   D = multi_dense, S = sparse_max, H = fusion_multi_sparse_max (the hybrid), measure ndcg_cut_10.
--   The budget (K_q*, K_p*) of a system is selected on its train split(s) by H and applied unchanged
--   to every test split. `diffret report` reads these views; `diffret sql` shows the same numbers.

-- view: query_tokens
-- files: tokens/tokenizer=*/dataset=*/side=query/shard=*.parquet
-- Query token ids (text only, in the model's tokenizer), for the query features.
CREATE OR REPLACE VIEW query_tokens AS
SELECT tokenizer, dataset, id AS query_id, n_tokens, token_ids
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'tokenizer': VARCHAR, 'dataset': VARCHAR, 'side': VARCHAR});

-- view: system_tokenizer
-- Which tokenizer folder each system's encodings were made from.
CREATE OR REPLACE VIEW system_tokenizer AS
SELECT DISTINCT partition ->> 'system' AS system, config ->> 'tokens' AS tokenizer
FROM manifests
WHERE stage = 'encodings';

-- view: budget_selection
-- Per system: the (K_q, K_p) with the best mean H NDCG@10 over its train split(s) (every dataset that has
-- one; ties: the smaller budget). train_ndcg_10 is that mean; train_on lists the datasets.
CREATE OR REPLACE VIEW budget_selection AS
WITH t AS (
    SELECT system, kq, kp, avg(ndcg_10) AS train_ndcg_10, count(*) AS train_datasets,
           string_agg(dataset, ',' ORDER BY dataset) AS train_on
    FROM cells
    WHERE split = 'train' AND mode = 'fusion_multi_sparse_max'
    GROUP BY system, kq, kp
)
SELECT system, kq AS kq_star, kp AS kp_star, train_ndcg_10, train_datasets, train_on
FROM t
QUALIFY row_number() OVER (PARTITION BY system ORDER BY train_datasets DESC, train_ndcg_10 DESC, kq + kp, kq) = 1;

-- view: selected_cells
-- Every non-train split at each system's selected budget, all modes (the budget is never re-picked on test).
CREATE OR REPLACE VIEW selected_cells AS
SELECT c.*, s.train_ndcg_10, s.train_on
FROM cells AS c
JOIN budget_selection AS s ON c.system = s.system AND c.kq = s.kq_star AND c.kp = s.kp_star
WHERE c.split <> 'train';

-- view: oracle
-- Per-query oracle (section 6.3), per system, dataset, split and mode, on NDCG@10:
--   fixed      = the selected budget (K_q*, K_p*)
--   kq_oracle  = per query the best K_q with K_p = K_p*
--   kp_oracle  = per query the best K_p with K_q = K_q*
--   joint      = per query the best (K_q, K_p)
-- By construction joint >= kq_oracle, kp_oracle >= fixed.
CREATE OR REPLACE VIEW oracle AS
WITH m AS (
    SELECT system, dataset, split, mode, kq, kp, query_id, value
    FROM metrics
    WHERE measure = 'ndcg_cut_10' AND mode <> 'bm25' AND split <> 'train'
), s AS (SELECT system, kq_star, kp_star FROM budget_selection),
fixed AS (
    SELECT m.system, dataset, split, mode, query_id, value AS v
    FROM m JOIN s ON m.system = s.system AND m.kq = s.kq_star AND m.kp = s.kp_star
), kq_only AS (
    SELECT m.system, dataset, split, mode, query_id, max(value) AS v
    FROM m JOIN s ON m.system = s.system AND m.kp = s.kp_star GROUP BY ALL
), kp_only AS (
    SELECT m.system, dataset, split, mode, query_id, max(value) AS v
    FROM m JOIN s ON m.system = s.system AND m.kq = s.kq_star GROUP BY ALL
), joint AS (
    SELECT system, dataset, split, mode, query_id, max(value) AS v FROM m GROUP BY ALL
)
SELECT f.system, f.dataset, f.split, f.mode,
       avg(f.v) AS fixed, avg(q.v) AS kq_oracle, avg(p.v) AS kp_oracle, avg(j.v) AS joint,
       count(*) AS queries
FROM fixed AS f
JOIN kq_only AS q USING (system, dataset, split, mode, query_id)
JOIN kp_only AS p USING (system, dataset, split, mode, query_id)
JOIN joint AS j USING (system, dataset, split, mode, query_id)
GROUP BY ALL;

-- view: query_features
-- Per query of a system's tokenizer: length in subwords (before truncation) and the Shannon entropy (bits)
-- of its token distribution (token counts within the query).
CREATE OR REPLACE VIEW query_features AS
WITH t AS (
    SELECT mt.system, q.dataset, q.query_id, q.n_tokens, q.token_ids
    FROM query_tokens AS q JOIN system_tokenizer AS mt ON q.tokenizer = mt.tokenizer
), c AS (
    SELECT system, dataset, query_id, tok, count(*) AS n
    FROM t, unnest(t.token_ids) AS u(tok)
    GROUP BY ALL
), e AS (
    SELECT system, dataset, query_id, -sum((n / total) * log2(n / total)) AS entropy
    FROM (SELECT *, sum(n) OVER (PARTITION BY system, dataset, query_id) AS total FROM c)
    GROUP BY ALL
)
SELECT t.system, t.dataset, t.query_id, t.n_tokens AS length, coalesce(e.entropy, 0.0) AS entropy
FROM t LEFT JOIN e USING (system, dataset, query_id);

-- view: query_peaks
-- Per query (section 6.4): the K_q that maximises its NDCG@10 at K_p = K_p* (ties: the smallest K_q),
-- for D (multi_dense) and S (sparse_max), with the query's features.
CREATE OR REPLACE VIEW query_peaks AS
WITH m AS (
    SELECT x.system, x.dataset, x.split, x.mode, x.kq, x.query_id, x.value
    FROM metrics AS x JOIN budget_selection AS s ON x.system = s.system AND x.kp = s.kp_star
    WHERE x.measure = 'ndcg_cut_10' AND x.mode IN ('multi_dense', 'sparse_max') AND x.split <> 'train'
), p AS (
    SELECT system, dataset, split, mode, query_id, kq AS peak_kq, value AS peak_ndcg_10
    FROM m
    QUALIFY row_number() OVER (PARTITION BY system, dataset, split, mode, query_id ORDER BY value DESC, kq) = 1
)
SELECT p.*, f.length, f.entropy
FROM p JOIN query_features AS f USING (system, dataset, query_id);

-- view: footprint
-- Bytes and files per stage and partition (from the manifests), the store's size by artifact.
CREATE OR REPLACE VIEW footprint AS
SELECT stage,
       partition ->> 'system' AS system,
       partition ->> 'dataset' AS dataset,
       partition ->> 'side' AS side,
       partition ->> 'k' AS k,
       count(*) AS files,
       sum(bytes) AS bytes,
       sum(rows) AS rows
FROM artifact_files
GROUP BY ALL;

-- view: index_costs
-- What each index of a corpus cost to build and store: the bag of tokens (diffret bot: no model), BM25's (built in
-- memory by every bm25 run: its seconds, no bytes kept) and a SIDR system's parametric index (its passage
-- encodings: bytes; their encoding time is not recorded by the encode stage).
CREATE OR REPLACE VIEW index_costs AS
SELECT 'bag of tokens' AS index, tokenizer AS name, dataset, bytes, build_seconds FROM bot_indexes
UNION ALL
SELECT 'bm25', system, dataset, NULL, max(index_seconds) FROM search_costs WHERE mode = 'bm25' GROUP BY ALL
UNION ALL
SELECT 'parametric (sidr)', f.system, f.dataset, sum(f.bytes), NULL
FROM footprint AS f JOIN systems AS s ON s.system = f.system
WHERE f.stage = 'encodings' AND f.side = 'passage' AND s.readout = 'sidr' GROUP BY ALL;
