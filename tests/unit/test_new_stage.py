"""Adding a stage is writing its module and registering it: a toy stage in a package of its own (a temporary
folder, nothing else in the repository touched) gets its CLI command, its Prefect flow with the config's typed
form, and its deployment in the generated prefect.yaml; run from the command line it writes its folder, and a
second run finds it current. What it needs beyond its units is declared on it and picked up by the generated
command and flow: a stage it runs first (the toy tokenizes its dataset first, as encode does) and what its command
prints after its result line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO

TOY = '''
"""A toy stage: one text file per name, after its dataset's queries are tokenized (first, when they are not yet)."""
from pydantic import Field

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.stages.base import Context, Folder, Plan, Stage, StageConfig
from diffret.stages.presentation import Presentation
from diffret.stages.tokenize import TokenizeConfig
from diffret.storage import Manifest


class ToyConfig(StageConfig):
    """Parameters of the toy stage."""

    name: str = Field(description="Whom to greet.")
    times: int = Field(default=2, ge=1, description="How many times.")
    dataset: str = Field(default="tiny", description="A stored dataset whose queries it counts.")
    backbone: BackboneConfig = Field(description="Whose tokenizer.")


class Toy(Stage, name="toy", config=ToyConfig, noun="greeting(s)", verb="written"):
    """Write a greeting into the store."""

    def prerequisites(self, config: ToyConfig) -> list[tuple[str, StageConfig]]:
        return [("tokenize", TokenizeConfig(root=config.root, dataset=config.dataset, sides=["query"],
                                            backbone=config.backbone))]

    def plan(self, config: ToyConfig, ctx: Context) -> Plan:
        plan = Plan(details={"who": config.name, "dataset": config.dataset})
        plan.add_folder(ctx, f"toys/name={config.name}", {"name": config.name, "times": config.times}, config.force)
        return plan

    def run(self, unit: Folder, ctx: Context) -> None:
        m = Manifest.new("toy", {"name": unit.config["name"]}, unit.config)
        with ctx.store.folder_writer(unit.stage, m) as w:
            w.write_file("greeting.txt", ("hello " * unit.config["times"]).encode())


stage = Toy()
presentation = Presentation(
    example={"name": "world"},
    printed=lambda result: [f"greeted {result.details['who']}, {result.details['dataset']} tokenized first"],
)
'''

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from diffret import stages
stages.register("toypkg.toy")
from typer.testing import CliRunner
from diffret.flows.cli import app
from diffret.flows.deployments import render
import diffret.flows.stage_flows
from diffret import flows
from prefect.utilities.callables import parameter_schema
runner = CliRunner()
store, beir, model = sys.argv[2:5]
dl = runner.invoke(app, ["download", "tiny", "--source", beir, "--root", store])
assert dl.exit_code == 0, dl.output
toy = ["toy", "--name", "you", "--times", "3", "--model", model, "--root", store]
first = runner.invoke(app, toy)
again = runner.invoke(app, toy)
schema = parameter_schema(flows.stage_flows.toy_flow).model_dump()
print(json.dumps({
    "help": runner.invoke(app, ["toy", "--help"]).output,
    "first": [first.exit_code, first.output], "again": [again.exit_code, again.output],
    "flow": flows.stage_flows.toy_flow.name, "form": sorted(schema["definitions"]["ToyConfig"]["properties"]),
    "yaml": render(),
}))
"""


def _sources() -> dict[str, bytes]:
    """The files adding a stage used to need edits in: the registry, the flows, the CLI and prefect.yaml."""
    files = [
        *(REPO / "diffret" / "stages").glob("*.py"),
        *(REPO / "diffret" / "flows").glob("*.py"),
        REPO / "prefect.yaml",
    ]
    return {str(f.relative_to(REPO)): f.read_bytes() for f in files}


def test_a_toy_stage_in_its_own_package_gets_command_flow_and_deployment(tmp_path: Path, tiny_beir: Path) -> None:
    from tiny_models import save_tiny_mlm

    model = save_tiny_mlm(tmp_path / "model")
    pkg = tmp_path / "pkg" / "toypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "toy.py").write_text(textwrap.dedent(TOY))
    before = _sources()
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "pkg"), str(tmp_path / "store"), str(tiny_beir), str(model)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert "--name" in got["help"] and "--times" in got["help"] and "Whom to greet." in got["help"]
    assert got["first"][0] == 0 and "1 greeting(s) written" in got["first"][1], got["first"]
    # its prerequisite ran first (the queries tokenized), and the command printed the stage's own line after its result
    lines = got["first"][1].splitlines()
    tokenized = next(i for i, line in enumerate(lines) if line.startswith("tokenize: ") and "1 shard(s)" in line)
    written = next(i for i, line in enumerate(lines) if line.startswith("1 greeting(s) written"))
    assert tokenized < written and lines[written + 1] == "greeted you, tiny tokenized first", lines
    assert list((tmp_path / "store" / "tokens").glob("tokenizer=*/dataset=tiny/side=query/shard=*.parquet"))
    assert got["again"][0] == 0 and "0 greeting(s) written, 1 already done" in got["again"][1], got["again"]
    assert "tokenize:" not in got["again"][1]  # nothing left to tokenize: not mentioned
    assert (tmp_path / "store" / "toys" / "name=you" / "greeting.txt").read_text() == "hello hello hello "
    assert got["flow"] == "toy" and {"name", "times", "root", "force"} <= set(got["form"])
    assert "- name: toy\n" in got["yaml"] and "entrypoint: diffret.flows.stage_flows:toy_flow" in got["yaml"]
    assert "      name: world\n" in got["yaml"] and "Write a greeting into the store." in got["yaml"]
    assert _sources() == before  # no file of the stage registry, the flows or the deployments was touched


def test_prefect_yaml_is_what_the_registry_generates() -> None:
    """The file users deploy is `diffret deployments --write`'s output: a stage added or changed without
    regenerating it fails here."""
    from diffret.flows.deployments import render

    assert (REPO / "prefect.yaml").read_text() == render(), "run `diffret deployments --write` from the repository root"
