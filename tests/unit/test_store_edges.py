"""Edges of what enters the store and what `verify` trusts: a judged query with empty text is stored with a warning
naming it (encoded as the prompt alone, it would count in every mean without a word), and a manifest whose stats
hold a number that is not finite (diffret writes one as null, so it was put there by hand) is damage that `verify`
names with its repair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_beir
from typer.testing import CliRunner

from diffret.flows.cli import app

CORPUS = [{"_id": f"d{i}", "title": "", "text": f"passage {i} about word{i}"} for i in range(4)]


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res.exit_code, " ".join(res.output.split())


def test_a_judged_query_with_empty_text_is_stored_with_a_warning_naming_it(tmp_path: Path) -> None:
    queries = [{"_id": "q1", "text": "word1"}, {"_id": "q2", "text": "  "}, {"_id": "q3", "text": ""}]
    beir = write_beir(tmp_path / "c", CORPUS, queries, {"test": [("q1", "d1", 1), ("q2", "d2", 1)]})
    code, out = invoke("download", "c", "--source", str(beir), "--root", str(tmp_path / "store"))
    assert code == 0, out
    assert "warning: c: 1 judged query has empty text ('q2'): encoded as the prompt alone" in out, out
    assert "'q3'" not in out.split("warning:")[1]  # judged nowhere: never encoded, so no warning
    queries[1]["text"] = "word2"
    beir = write_beir(tmp_path / "c2", CORPUS, queries, {"test": [("q1", "d1", 1), ("q2", "d2", 1)]})
    code, out = invoke("download", "c2", "--source", str(beir), "--root", str(tmp_path / "store"))
    assert code == 0 and "warning" not in out, out


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_number_that_is_not_finite_in_a_manifest_s_stats_is_damage_verify_names(tmp_path: Path, value: str) -> None:
    beir = write_beir(tmp_path / "c", CORPUS, [{"_id": "q1", "text": "word1"}], {"test": [("q1", "d1", 1)]})
    root = str(tmp_path / "store")
    assert invoke("download", "c", "--source", str(beir), "--root", root)[0] == 0
    assert invoke("verify", "--root", root)[0] == 0
    path = tmp_path / "store" / "datasets" / "dataset=c" / "_manifest.json"
    m = json.loads(path.read_text())
    m["stats"]["by_hand"] = {"value": float(value.replace("Infinity", "inf"))}
    path.write_text(json.dumps(m, indent=2))  # json writes NaN / Infinity as they are
    assert value in path.read_text()
    code, out = invoke("verify", "--root", root)
    assert code == 1, out
    assert "manifest edited by hand (its stats (stats.by_hand.value is" in out and "not finite" in out, out
    assert f"repair: run `diffret download c --root {root}` again with the settings that made it" in out, out
    code, out = invoke("sql", "--root", root, "select count(*) as n from corpus")
    assert code == 0 and "warning: view corpus leaves out a damaged folder" in out, out
    assert invoke("download", "--root", root, "c", "--source", str(beir))[0] == 0  # the repair, with its source
    assert invoke("verify", "--root", root) == (0, "3 file(s) match their manifests")
