-- view: budget_features
-- files: features/system=*/dataset=*/split=*/set=*/features.parquet
-- Query features for adaptive budgets (diffret budget), one row per (query, feature): length_tokens, length_words
-- (free at query time) and, in set `encoding`, <feature>@<K> from the query's stored encoding at K (slots, distinct,
-- sparse_mass, support, agreement; one query pass per K at query time).
CREATE OR REPLACE VIEW budget_features AS
SELECT *
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'system': VARCHAR, 'dataset': VARCHAR, 'split': VARCHAR, 'set': VARCHAR});
