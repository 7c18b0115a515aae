"""Test collections: where they come from (catalog, mirrors, checksummed downloads) and how their files are
read and validated (BEIR jsonl / tsv, MS MARCO, TREC DL)."""
