-- view: compressed_systems
-- One row per compressed encoder system (diffret compress, diffret encode --store): its storage choice and seed,
-- and the float16 system it stands for (the same encoder, vectors as encoded).
CREATE OR REPLACE VIEW compressed_systems AS
SELECT partition ->> 'system' AS system, config -> 'settings' ->> 'store' AS store,
       CAST(config -> 'settings' ->> 'store_seed' AS INTEGER) AS store_seed, stats ->> 'float16_system' AS float16_system
FROM manifests
WHERE stage = 'systems' AND stats ->> 'float16_system' IS NOT NULL;

-- view: vector_bytes
-- files: encodings/system=*/dataset=*/side=passage/k=*/shard=*.parquet
-- Bytes on disk per passage encoding folder, measured from the Parquet metadata (compressed column chunks): per
-- vector (the dense or codes column over the vectors stored) and per passage (every column: the sparse side too),
-- with the storage choice (float16 for a system that is not compressed) and its codebook's bytes (not in the
-- per-vector figures: a codebook is paid once per K_p, however large the corpus).
CREATE OR REPLACE VIEW vector_bytes AS
WITH chunks AS (
    SELECT regexp_extract(file_name, 'system=([^/]+)', 1) AS system,
           regexp_extract(file_name, 'dataset=([^/]+)', 1) AS dataset,
           CAST(regexp_extract(file_name, '/k=([0-9]+)/', 1) AS INTEGER) AS k,
           sum(total_compressed_size) FILTER (WHERE split_part(path_in_schema, ',', 1) IN ('dense', 'codes'))
               AS vector_bytes,
           sum(total_compressed_size) AS all_bytes
    FROM parquet_metadata(@files)
    GROUP BY ALL
), counts AS (
    SELECT system, dataset, k, count(*) AS passages, sum(n_reps) AS vectors
    FROM read_parquet(@files, hive_partitioning = true, union_by_name = true,
                      hive_types = {'system': VARCHAR, 'dataset': VARCHAR, 'side': VARCHAR, 'k': INTEGER})
    GROUP BY ALL
), codebooks AS (
    SELECT partition ->> 'system' AS system, partition ->> 'dataset' AS dataset,
           CAST(partition ->> 'k' AS INTEGER) AS k, sum(bytes) AS codebook_bytes
    FROM artifact_files WHERE stage = 'codebooks'
    GROUP BY ALL
)
SELECT c.system, c.dataset, c.k AS kp, coalesce(s.store, 'float16') AS store, n.passages, n.vectors,
       c.vector_bytes, c.all_bytes, c.vector_bytes / n.vectors AS bytes_per_vector,
       c.all_bytes / n.passages AS bytes_per_passage, coalesce(b.codebook_bytes, 0) AS codebook_bytes
FROM chunks c JOIN counts n USING (system, dataset, k)
LEFT JOIN compressed_systems s ON s.system = c.system
LEFT JOIN codebooks b ON b.system = c.system AND b.dataset = c.dataset AND b.k = c.k;

-- view: compression_effect
-- Each compressed system's cells against its float16 system's, cell by cell (same dataset, split, K_q, K_p,
-- mode): the NDCG@10 and MRR@10 changes (compressed minus float16) and the bytes per passage of both.
CREATE OR REPLACE VIEW compression_effect AS
SELECT s.system, s.float16_system, s.store, c.dataset, c.split, c.kq, c.kp, c.mode,
       f.ndcg_10 AS float16_ndcg_10, c.ndcg_10, c.ndcg_10 - f.ndcg_10 AS ndcg_10_change,
       f.mrr_10 AS float16_mrr_10, c.mrr_10, c.mrr_10 - f.mrr_10 AS mrr_10_change,
       fb.bytes_per_passage AS float16_bytes_per_passage, vb.bytes_per_passage
FROM compressed_systems s
JOIN cells c ON c.system = s.system
JOIN cells f ON f.system = s.float16_system AND f.dataset = c.dataset AND f.split = c.split AND f.kq = c.kq
            AND f.kp = c.kp AND f.mode = c.mode
LEFT JOIN vector_bytes vb ON vb.system = s.system AND vb.dataset = c.dataset AND vb.kp = c.kp
LEFT JOIN vector_bytes fb ON fb.system = s.float16_system AND fb.dataset = c.dataset AND fb.kp = c.kp;
