-- view: manifests
-- files: **/_manifest.json
-- One row per stage folder: what produced it and when.
CREATE OR REPLACE VIEW manifests AS
SELECT
    regexp_replace(filename, '/_manifest\.json$', '') AS folder,
    content::JSON ->> 'stage' AS stage,
    content::JSON -> 'partition' AS partition,
    content::JSON ->> 'config_hash' AS config_hash,
    content::JSON -> 'config' AS config,
    content::JSON ->> 'created_at' AS created_at,
    content::JSON -> 'versions' AS versions,
    content::JSON -> 'stats' AS stats,
    content::JSON -> 'files' AS files
FROM read_text(@files)
WHERE content::JSON ->> 'stage' IS NOT NULL;

-- view: artifact_files
-- One row per file listed in a manifest: the store's footprint, by stage and partition.
CREATE OR REPLACE VIEW artifact_files AS
SELECT
    m.folder,
    m.stage,
    m.partition,
    f.name AS file,
    CAST(m.files -> f.name ->> 'bytes' AS BIGINT) AS bytes,
    CAST(m.files -> f.name ->> 'rows' AS BIGINT) AS rows,
    m.files -> f.name ->> 'sha256' AS sha256
FROM manifests AS m, unnest(json_keys(m.files)) AS f(name);

-- view: dataset_summary
-- Per collection and split: judged queries, judgments, documents in the corpus.
CREATE OR REPLACE VIEW dataset_summary AS
WITH q AS (
    SELECT dataset, split, count(DISTINCT query_id) AS judged_queries, count(*) AS judgments,
           count(*) FILTER (WHERE relevance > 0) AS relevant
    FROM qrels GROUP BY ALL
), c AS (SELECT dataset, count(*) AS documents FROM corpus GROUP BY ALL)
SELECT q.dataset, q.split, q.judged_queries, q.judgments, q.relevant, c.documents
FROM q LEFT JOIN c USING (dataset)
ORDER BY q.dataset, q.split;

-- view: systems
-- One row per system in the registry (systems/system=<slug>/_manifest.json): what it is and every setting
-- that made it. `diffret systems` prints this view.
CREATE OR REPLACE VIEW systems AS
SELECT partition ->> 'system' AS system,
       config ->> 'kind' AS kind,
       config ->> 'model' AS model,
       config ->> 'readout' AS readout,
       config -> 'settings' AS settings,
       created_at
FROM manifests
WHERE stage = 'systems';
