-- view: training_groups
-- files: training/set=*/groups.parquet
-- One row per training group (Tevatron's format): the query, its positive and hard-negative passages
-- (lists of {docid, title, text}) and their counts.
CREATE OR REPLACE VIEW training_groups AS
SELECT "set", query_id, query, len(positive_passages) AS n_positives, len(negative_passages) AS n_negatives,
       positive_passages, negative_passages
FROM read_parquet(@files, hive_partitioning = true, hive_types = {'set': VARCHAR});

-- view: train_log
-- files: models/model=*/train_log.parquet
-- One row per optimizer step of each fine-tuned model: the loss, its dense and sparse parts (SIDR: its top-k and
-- bag-of-tokens parts), lr, samples/s.
CREATE OR REPLACE VIEW train_log AS
SELECT model, step, loss, dense, sparse, topk, bot, lr, samples_per_s
FROM read_parquet(@files, hive_partitioning = true, hive_types = {'model': VARCHAR}, union_by_name = true);
