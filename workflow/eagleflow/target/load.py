"""Loading a target's tokenizer and text model with transformers, wrappers and shipped code
included.

Code shipped in the target directory (Kimi-K2.5's tiktoken tokenizer, reached through
`auto_map`) runs only with `target.trust_remote_code: true`. The workflow checks that once,
before any job runs (`eagleflow.target.checks.check_target_code`, called by common.smk), and
hands the key to vLLM through `EngineSettings`; the loaders here then trust exactly the
directories that need it.

A multimodal wrapper (`KimiK25ForConditionalGeneration`) stores its text model under the hub's
names, `language_model.model.*` and `language_model.lm_head.weight`; `load_causal_lm` builds
the text model alone from `text_config` and maps those names onto it (no vision weights are
read), an independent forward of the weights vLLM serves.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagleflow.target.info import TargetError, read_target

CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json")


def _auto_map_modules(cfg: dict) -> set[str]:
    mods = set()
    for ref in (cfg.get("auto_map") or {}).values():
        for r in ref if isinstance(ref, list) else [ref]:
            if r and "." in r:
                mods.add(r.split("--")[-1].rsplit(".", 1)[0])
    return mods


def remote_code_files(path) -> list[Path]:
    """The Python files of the target directory that transformers or vLLM will run: the
    modules named by `auto_map` in its config files, and what they import from the directory
    (every other `.py` file there, to be safe)."""
    path = Path(path)
    named = set()
    for name in CONFIG_FILES:
        f = path / name
        if f.is_file():
            try:
                named |= _auto_map_modules(json.loads(f.read_text()))
            except json.JSONDecodeError:
                continue
    if not named:
        return []
    return sorted(path.glob("*.py"))


def needs_remote_code(path) -> bool:
    return bool(remote_code_files(path))


def check_remote_code(path, trust: bool) -> None:
    """One sentence naming the key when the target ships code and it may not run."""
    files = remote_code_files(path)
    if files and not trust:
        names = ", ".join(f.name for f in files)
        raise TargetError(
            f"{path} ships code that transformers and vLLM must run to load it ({names}); "
            "read it, then set `target.trust_remote_code: true` to allow it"
        )


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=needs_remote_code(path))


def load_causal_lm(path, dtype):
    """transformers' causal LM of the target's text model, in `dtype`, in eval mode."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    info = read_target(path)
    if info.wrapper is None:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    text = dict(info.text_config)
    model_type = {"kimi_k2": "deepseek_v3"}.get(text.get("model_type"), text.get("model_type"))
    text.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise TargetError(f"{path}: text_config model_type {model_type!r} unknown to transformers")
    model, loading = AutoModelForCausalLM.from_pretrained(
        str(path),
        config=CONFIG_MAPPING[model_type](**text),
        dtype=dtype,
        key_mapping={r"^language_model\.": ""},
        output_loading_info=True,
    )
    if loading["missing_keys"]:
        raise TargetError(
            f"{path}: the text model's weights lack {sorted(loading['missing_keys'])[:3]}"
        )
    return model.eval()
