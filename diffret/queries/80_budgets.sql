-- view: budget_features
-- files: features/system=*/dataset=*/split=*/set=*/features.parquet
-- Query features for adaptive budgets (diffret budget), one row per (query, feature): length_tokens, length_words
-- (free at query time) and, in set `encoding`, <feature>@<K> from the query's stored encoding at K (slots, distinct,
-- sparse_mass, support, agreement, and entropy_* / maxprob_* of the LM head where encode stored them with
-- --head-stats; one query pass per K at query time).
CREATE OR REPLACE VIEW budget_features AS
SELECT *
FROM read_parquet(@files, hive_partitioning = true,
                  hive_types = {'system': VARCHAR, 'dataset': VARCHAR, 'split': VARCHAR, 'set': VARCHAR});

-- view: adaptive_runs
-- One row per adaptive run (diffret budget): the selector, what it chose from (base mode, over kq / kp / joint,
-- feature set, train split, the fixed budget learned there), the cells chosen (histogram JSON), the features'
-- importances and hyper-parameters (JSON), and what the choice costs at query time.
CREATE OR REPLACE VIEW adaptive_runs AS
SELECT partition ->> 'system' AS system, partition ->> 'dataset' AS dataset, partition ->> 'split' AS split,
       partition ->> 'mode' AS mode, config ->> 'selector' AS selector, config ->> 'base_mode' AS base_mode,
       config ->> 'over' AS over_axis, config ->> 'features' AS features, config ->> 'train_split' AS train_split,
       config ->> 'measure' AS measure, coalesce(CAST(config ->> 'cross_fit' AS BOOLEAN), false) AS cross_fit,
       CAST(stats -> 'fixed' ->> 0 AS INTEGER) AS fixed_kq, CAST(stats -> 'fixed' ->> 1 AS INTEGER) AS fixed_kp,
       config -> 'cells' AS cells, stats -> 'histogram' AS histogram,
       stats -> 'selector' -> 'importances' AS importances,
       stats -> 'selector' -> 'params' AS params, stats -> 'selector' -> 'learned' AS learned,
       CAST(stats -> 'selector' ->> 'cv_score' AS DOUBLE) AS cv_score,
       CAST(stats -> 'cost' ->> 'passage_indexes' AS INTEGER) AS passage_indexes,
       CAST(stats -> 'cost' ->> 'query_passes' AS INTEGER) AS query_passes, stats -> 'cost' ->> 'note' AS cost
FROM manifests WHERE stage = 'runs' AND config ->> 'selector' IS NOT NULL;
