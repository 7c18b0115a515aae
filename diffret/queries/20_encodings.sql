-- view: tokens
-- files: tokens/tokenizer=*/dataset=*/side=*/shard=*.parquet
-- Text token ids per (tokenizer, dataset, side); n_tokens is the length before truncation.
CREATE OR REPLACE VIEW tokens AS
SELECT tokenizer, dataset, side, id, n_tokens, truncated, len(token_ids) AS kept_tokens
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'tokenizer': VARCHAR, 'dataset': VARCHAR, 'side': VARCHAR});

-- view: encodings
-- files: encodings/system=*/dataset=*/side=*/k=*/shard=*.parquet
-- One row per (system, dataset, side, K, text). `dense` is [n_reps][H] float16; a compressed system's passages
-- have `codes` instead (one fixed-size binary code per vector, storage/codecs.py); select them only when needed.
-- Files are read by column name, so folders with and without codes or head stats mix.
CREATE OR REPLACE VIEW encodings AS
SELECT system, dataset, side, k, id, n_reps, n_tokens, stopped, tokens,
       len(sparse_ids) AS sparse_nnz, sparse_ids, sparse_weights,
       * EXCLUDE (system, dataset, side, k, id, n_reps, n_tokens, stopped, tokens, sparse_ids, sparse_weights)
FROM read_parquet(@files, hive_partitioning = true, union_by_name = true,
                  hive_types = {'system': VARCHAR, 'dataset': VARCHAR, 'side': VARCHAR, 'k': INTEGER});

-- view: bot
-- files: bot/tokenizer=*/dataset=*/bot.parquet
-- SIDR's binary bag-of-tokens index: one row per passage, its distinct token ids (special ids dropped).
CREATE OR REPLACE VIEW bot AS
SELECT tokenizer, dataset, id, len(token_ids) AS n_distinct, token_ids
FROM read_parquet(@files, hive_partitioning = true, hive_types = {'tokenizer': VARCHAR, 'dataset': VARCHAR});

-- view: bot_indexes
-- One row per bag-of-tokens index: what building it cost (no model: a pass over the stored token ids).
CREATE OR REPLACE VIEW bot_indexes AS
SELECT partition ->> 'tokenizer' AS tokenizer, partition ->> 'dataset' AS dataset,
       CAST(stats ->> 'passages' AS BIGINT) AS passages, CAST(stats ->> 'nnz' AS BIGINT) AS nnz,
       CAST(stats ->> 'bytes' AS BIGINT) AS bytes, CAST(stats ->> 'build_seconds' AS DOUBLE) AS build_seconds,
       CAST(stats ->> 'density' AS DOUBLE) AS density, created_at
FROM manifests WHERE stage = 'bot';
