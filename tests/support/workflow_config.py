"""The workflow config as the rules read it: config/config.yaml with a test's changes merged in
(as `--configfile` merges them), validated against the schema, which fills every default."""

import yaml
from snakemake.utils import validate

from eagleflow.plan.settings import DraftSettings
from support.workflow_runner import REPO, merged

SCHEMA = str(REPO / "workflow" / "schemas" / "config.schema.yaml")


def workflow_config(override: dict | None = None, example: str | None = None) -> dict:
    """The default config, then config/examples/`example` and `override` merged over it."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    if example:
        config = merged(
            config, yaml.safe_load((REPO / "config" / "examples" / example).read_text())
        )
    config = merged(config, override or {})
    validate(config, SCHEMA)
    return config


def draft_settings(draft: dict | None = None, **sections) -> DraftSettings:
    """The typed `draft:` section of the default config with `draft` merged into it (and other
    sections, e.g. `extract={"device": "cuda"}`)."""
    return DraftSettings.from_config(workflow_config({"draft": draft or {}, **sections}))
