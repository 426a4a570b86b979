"""Every `snakemake` command that README.md and docs/ show in a ```bash block dry-runs (`-n`),
so that no documented command can rot.

Each runs as documented, from a scratch copy of the repository's config/ standing in for the
repository root (relative paths such as `config/examples/...` resolve as they would there),
with these stand-ins for what a user's machine has and this one may not:
- a config's `target.path` that does not exist points to a fake DeepSeek-V3 directory (real
  config.json and a tokenizer), and a `data.path` that does not exist to a small dataset;
- `--profile slurm` finds profiles/slurm (as envs/setup-cpu.sh links it), not the user's own;
- `--sdm conda` is dropped: Snakemake calls `conda info` even for a dry run.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from support.workflow_runner import REPO, SNAKEMAKE

FENCE = re.compile(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", re.S | re.M)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Options that cannot be dry-run here, with the number of values each takes.
DROPPED = {"--sdm": 1, "--software-deployment-method": 1, "--use-conda": 0}


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def documented_commands() -> dict[str, tuple[str, dict]]:
    """{command: (first place shown, environment exported before it in its block)}."""
    found = {}
    for doc in documents():
        text = doc.read_text()
        for block in FENCE.finditer(text):
            env = {}
            first_line = text.count("\n", 0, block.start(1)) + 1
            lines = block.group(1).replace("\\\n", " ").splitlines()
            for offset, line in enumerate(lines):
                for segment in re.split(r"&&|;|\|\|", line.split(" #")[0]):
                    words = shlex.split(segment, comments=True)
                    if words[:1] == ["export"]:
                        env.update(w.split("=", 1) for w in words[1:] if "=" in w)
                        continue
                    prefix = {}
                    while words and ASSIGNMENT.match(words[0]):
                        key, value = words.pop(0).split("=", 1)
                        prefix[key] = value
                    if words[:1] == ["snakemake"]:
                        where = f"{doc.relative_to(REPO)}:{first_line + offset}"
                        found.setdefault(shlex.join(words), (where, {**env, **prefix}))
    return found


COMMANDS = documented_commands()


def test_the_readme_shows_snakemake_commands():
    readme = [c for c, (where, _) in COMMANDS.items() if where.startswith("README.md")]
    assert len(readme) >= 3, COMMANDS


def dry_run_args(command: str) -> list[str]:
    words = shlex.split(command)[1:]
    args = []
    while words:
        word = words.pop(0)
        name = word.split("=", 1)[0]
        if name in DROPPED:
            if "=" not in word:
                del words[: DROPPED[name]]
            continue
        args.append(word)
    return [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), *args, "--dry-run"]


def needs_stand_in(workdir: Path, path: str) -> bool:
    """A path that does not exist here and that the workflow does not build (resources/)."""
    return not path.startswith("resources/") and not (workdir / path).exists()


def stand_in_for_missing_inputs(workdir: Path, args: list[str], target: Path) -> None:
    """Point a config file's target and data that do not exist here at stand-ins."""
    configfiles = [
        a
        for i, a in enumerate(args)
        if i > 0 and args[i - 1] == "--configfile" and a.endswith((".yaml", ".yml"))
    ]
    for name in configfiles:
        path = workdir / name
        cfg = yaml.safe_load(path.read_text())
        if needs_stand_in(workdir, cfg["target"]["path"]):
            cfg["target"]["path"] = str(target)
        data = cfg.get("data", {}).get("path")
        if data and needs_stand_in(workdir, data):
            rows = [
                {
                    "messages": [
                        {"role": "user", "content": f"What is {i} plus 1?"},
                        {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."},
                    ]
                }
                for i in range(20)
            ]
            dest = workdir / data if not os.path.isabs(data) else workdir / "data" / "train.jsonl"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text("".join(json.dumps(r) + "\n" for r in rows))
            cfg["data"]["path"] = str(dest.relative_to(workdir))
        path.write_text(yaml.safe_dump(cfg))


@pytest.mark.parametrize("command", list(COMMANDS), ids=[w for w, _ in COMMANDS.values()])
def test_documented_command_dry_runs(command, fake_deepseek_v3, tmp_path):
    where, exported = COMMANDS[command]
    workdir = tmp_path / "repo"
    workdir.mkdir()
    shutil.copytree(REPO / "config", workdir / "config")
    profiles = tmp_path / "xdg" / "snakemake"
    profiles.mkdir(parents=True)
    (profiles / "slurm").symlink_to(REPO / "profiles" / "slurm")
    args = dry_run_args(command)
    stand_in_for_missing_inputs(workdir, args, fake_deepseek_v3)
    env = {**os.environ, **exported, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    proc = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "This was a dry-run" in out, (
        f"{where}: `{command}` does not dry-run:\n{out[-4000:]}"
    )
