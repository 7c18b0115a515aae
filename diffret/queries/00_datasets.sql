-- view: corpus
-- files: datasets/dataset=*/corpus.parquet
-- One row per document; `dataset` comes from the hive partition.
CREATE OR REPLACE VIEW corpus AS
SELECT dataset, doc_id, title, text, metadata
FROM read_parquet(@files, hive_partitioning = true, hive_types = {'dataset': VARCHAR});

-- view: queries
-- files: datasets/dataset=*/queries.parquet
-- One row per (query, split judging it); split is NULL for a query judged in no split.
CREATE OR REPLACE VIEW queries AS
SELECT dataset, query_id, text, split, metadata
FROM read_parquet(@files, hive_partitioning = true, hive_types = {'dataset': VARCHAR});

-- view: qrels
-- files: datasets/dataset=*/qrels.parquet
CREATE OR REPLACE VIEW qrels AS
SELECT dataset, split, query_id, doc_id, relevance
FROM read_parquet(@files, hive_partitioning = true, hive_types = {'dataset': VARCHAR});
