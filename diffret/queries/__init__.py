"""DuckDB SQL over the artifact store: view definitions (``views/``-style ``*.sql`` files here).

Each view file starts with header comments:
    -- view: <name>
    -- files: <glob relative to the store root>   (optional; the view reads these files)
and uses ``@files`` where the list of files goes. Only files listed in their folder's
``_manifest.json`` are included, so a half-written stage never shows up in SQL.
The loader is ``storage.sql``.
"""
