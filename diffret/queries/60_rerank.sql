-- Reranking (diffret rerank, DiffuRank): each reranker's runs against the first-stage run it reordered.

-- view: rerank_gains
-- One row per (reranker, dataset, split): the reranked run's mean NDCG@10 / MRR@10 and the first-stage
-- run's on the same queries (the reranker's registry record names the first stage: system, kq, kp, mode).
CREATE OR REPLACE VIEW rerank_gains AS
WITH r AS (
    SELECT system, model, readout AS method,
           settings -> 'first_stage' ->> 'system' AS first_stage,
           CAST(settings -> 'first_stage' ->> 'kq' AS INTEGER) AS first_kq,
           CAST(settings -> 'first_stage' ->> 'kp' AS INTEGER) AS first_kp,
           settings -> 'first_stage' ->> 'mode' AS first_mode,
           CAST(settings ->> 'depth' AS INTEGER) AS depth
    FROM systems
    WHERE kind = 'reranker'
)
SELECT r.system, r.model, r.method, c.dataset, c.split, r.depth, r.first_stage, r.first_kq, r.first_kp,
       r.first_mode, c.ndcg_10, f.ndcg_10 AS first_ndcg_10, c.ndcg_10 - f.ndcg_10 AS ndcg_10_gain,
       c.mrr_10, f.mrr_10 AS first_mrr_10, c.queries
FROM r
JOIN cells AS c ON c.system = r.system AND c.mode = 'rerank'
LEFT JOIN cells AS f ON f.system = r.first_stage AND f.kq = r.first_kq AND f.kp = r.first_kp
                    AND f.mode = r.first_mode AND f.dataset = c.dataset AND f.split = c.split;
