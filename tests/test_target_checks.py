"""The parse-time checks of `target.path` (eagleflow.target.checks): one sentence naming the key
to change, for a missing target and for shipped code that may not run."""

import json

import pytest

from eagleflow.logs import UserError
from eagleflow.target.checks import check_target_code, check_target_path
from eagleflow.target.info import TargetError


def model_dir(tmp_path, auto_map=None):
    d = tmp_path / "model"
    d.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"]}
    if auto_map:
        cfg["auto_map"] = auto_map
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_an_existing_model_directory_passes(tmp_path):
    check_target_path(str(model_dir(tmp_path)))


def a_file(tmp_path):
    (tmp_path / "file").write_text("")
    return tmp_path / "file"


def an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda p: p / "absent", "does not exist"),
        (a_file, "is not a directory"),
        (an_empty_directory, "has no config.json"),
    ],
)
def test_a_missing_target_is_one_sentence_naming_the_key(tmp_path, make, problem):
    path = str(make(tmp_path))
    with pytest.raises(TargetError, match=rf"^target\.path: .* {problem}; set `target\.path`"):
        check_target_path(path)


def test_relative_paths_name_the_directory_they_are_relative_to(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TargetError, match=rf"absent \(relative to {tmp_path}\) does not exist"):
        check_target_path("absent")


def test_a_target_the_workflow_builds_need_not_exist_yet(tmp_path):
    built = str(tmp_path / "resources" / "targets" / "tiny")
    check_target_path(built, built=[built])
    with pytest.raises(TargetError):
        check_target_path(built, built=["another"])


def test_a_built_target_that_ships_code_needs_trust_before_it_exists(tmp_path):
    kimi = str(tmp_path / "tiny-kimi")
    with pytest.raises(TargetError, match=r"ships its tokenizer as code.*trust_remote_code: true"):
        check_target_code(kimi, trust=False, built_with_code=[kimi])
    check_target_code(kimi, trust=True, built_with_code=[kimi])
    check_target_code(kimi, trust=False)  # not built with code, not there: nothing to check


def test_an_existing_target_with_code_needs_trust(tmp_path):
    d = model_dir(tmp_path, auto_map={"AutoTokenizer": ["tokenization_x.TokenizerX", None]})
    (d / "tokenization_x.py").write_text("")
    with pytest.raises(TargetError, match=r"tokenization_x\.py.*trust_remote_code: true"):
        check_target_code(str(d), trust=False)
    check_target_code(str(d), trust=True)


def test_an_existing_target_without_code_passes_untrusted(tmp_path):
    d = model_dir(tmp_path)
    (d / "helper.py").write_text("")  # no auto_map names it: transformers will not run it
    check_target_code(str(d), trust=False)


def test_the_errors_are_user_errors():
    # common.smk turns them into a WorkflowError; a job's log prints them as one sentence.
    assert issubclass(TargetError, UserError)
