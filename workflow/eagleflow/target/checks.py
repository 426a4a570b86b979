"""Checks of `target.path` made while Snakemake parses the workflow (common.smk), before the
DAG is built: a missing target, or one whose shipped code may not run, is one sentence naming
the key to change, not an input function's traceback. Each raises `TargetError`, which
common.smk turns into a `WorkflowError`.

The targets the workflow builds itself (the embedded ones) do not exist at parse time: the
caller names them, and `built_with_code` those of them that ship code (the Kimi replica's
tokenizer), which are refused without `target.trust_remote_code` before they are built.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from eagleflow.target.info import TargetError
from eagleflow.target.load import check_remote_code


def check_target_path(path: str, built: Collection[str] = ()) -> None:
    """A target the workflow does not build (`built`) must be a directory with a config.json."""
    if path in built:
        return
    where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
    if not os.path.isdir(path):
        problem = "does not exist" if not os.path.exists(path) else "is not a directory"
    elif not os.path.isfile(os.path.join(path, "config.json")):
        problem = "has no config.json"
    else:
        return
    raise TargetError(
        f"target.path: {path}{where} {problem}; set `target.path` in the config file to a local "
        "Hugging Face model directory (config.json, tokenizer files and safetensors weights)."
    )


def check_target_code(path: str, trust: bool, built_with_code: Collection[str] = ()) -> None:
    """A target that ships code runs it only with `target.trust_remote_code: true`: one that
    the workflow builds with code (`built_with_code`) is refused by name, an existing one by
    what its directory holds (`eagleflow.target.load.check_remote_code`)."""
    if path in built_with_code and not trust:
        raise TargetError(
            f"{path} ships its tokenizer as code; set `target.trust_remote_code: true` to allow it"
        )
    if os.path.isdir(path):
        check_remote_code(path, trust)
