"""What each draft.states mode costs, stated before anything runs (eagleflow.plan.stream_cost):
bytes of states on disk, target prefill-hours per epoch and in all, the training rate when the
engine is slower than the trainer; in `snakemake progress` and validate_env."""

import math

import pytest

from eagleflow.plan.stream_cost import StatesCost

BPT = 4 * 7168 * 2  # 4 layers of a hidden size 7168, bf16
FIGURES = dict(
    tokens_per_epoch=1_200_000,
    loss_tokens_per_epoch=600_000,  # half of the tokens are loss-masked
    extracted_tokens=1_300_000,  # the training samples and the held-out ones
    bytes_per_token=BPT,
    engine_tokens_per_second=2_300.0,
    trainer_tokens_per_second=9_000.0,
)


def cost(mode, epochs=3, cache_bytes=0, **figures):
    return StatesCost(mode=mode, epochs=epochs, cache_bytes=cache_bytes, **{**FIGURES, **figures})


def test_stored_writes_every_token_once_and_prefills_once():
    c = cost("stored")
    assert c.bytes_on_disk == 1_300_000 * BPT
    assert c.prefill_tokens(1) == c.prefill_tokens(3) == 0
    assert c.prefill_tokens_total == 1_300_000
    assert c.prefill_hours_total == pytest.approx(1_300_000 / 2_300 / 3600)
    assert c.training_rate(1) == c.training_rate(2) == 9_000.0  # read from disk
    assert c.training_hours == pytest.approx(3 * 600_000 / 9_000 / 3600)


def test_stream_writes_nothing_and_prefills_every_epoch():
    c = cost("stream")
    assert c.bytes_on_disk == 0 and c.cached_fraction == 0
    assert c.prefill_tokens(1) == c.prefill_tokens(3) == 1_200_000
    assert c.prefill_hours(1) == pytest.approx(1_200_000 / 2_300 / 3600)
    assert c.prefill_hours_total == pytest.approx(3 * c.prefill_hours(1))
    assert cost("stream", epochs=5).prefill_hours_total == pytest.approx(5 * c.prefill_hours(1))


def test_stream_trains_at_the_slower_of_engine_and_trainer_in_loss_masked_tokens():
    slow_engine = cost("stream")
    # 2,300 tok/s prefilled carry 1,150 loss-masked tok/s: slower than the trainer's 9,000
    assert slow_engine.engine_loss_tokens_per_second == pytest.approx(1_150)
    assert slow_engine.training_rate(1) == pytest.approx(min(9_000, 1_150))
    assert slow_engine.as_dict()["engine_limits_training"]
    fast_engine = cost("stream", engine_tokens_per_second=50_000.0)
    assert fast_engine.training_rate(1) == 9_000.0
    assert not fast_engine.as_dict()["engine_limits_training"]
    assert slow_engine.training_hours == pytest.approx(3 * 600_000 / 1_150 / 3600)


def test_cached_keeps_at_most_cache_bytes_and_prefills_the_rest_in_later_epochs():
    budget = 20 * 2**30
    c = cost("cached", cache_bytes=budget)
    epoch_bytes = 1_200_000 * BPT
    assert c.bytes_on_disk == budget <= c.cache_bytes and budget < epoch_bytes
    f = budget / epoch_bytes
    assert c.cached_fraction == pytest.approx(f)
    assert c.prefill_tokens(1) == 1_200_000  # epoch 1 streams everything
    assert c.prefill_tokens(2) == c.prefill_tokens(3) == round(1_200_000 * (1 - f))
    assert c.prefill_hours_total == pytest.approx(
        (1_200_000 + 2 * round(1_200_000 * (1 - f))) / 2_300 / 3600
    )
    # epoch 1 at the engine's pace; later the engine prefills only the uncached share
    assert c.training_rate(1) == pytest.approx(1_150)
    assert c.training_rate(2) == pytest.approx(min(9_000, 1_150 / (1 - f)))
    assert cost("stream").prefill_hours_total > c.prefill_hours_total > c.prefill_hours(1)


def test_cached_with_room_for_an_epoch_is_stream_once_then_the_trainer():
    c = cost("cached", cache_bytes=10**15)
    assert c.bytes_on_disk == 1_200_000 * BPT < c.cache_bytes
    assert c.prefill_tokens(2) == 0 and math.isinf(c.engine_limit(2))
    assert c.prefill_hours_total == pytest.approx(cost("stream").prefill_hours(1))
    assert c.training_rate(1) == pytest.approx(1_150) and c.training_rate(2) == 9_000.0
    none = cost("cached", cache_bytes=0)
    assert none.bytes_on_disk == 0
    assert none.prefill_hours_total == pytest.approx(cost("stream").prefill_hours_total)


@pytest.mark.parametrize("mode", ["stored", "stream", "cached"])
def test_lines_name_the_mode_its_costs_and_the_config_keys(mode):
    c = cost(mode, cache_bytes=20 * 2**30)
    lines = c.lines()
    assert 2 <= len(lines) <= 4, lines
    text = "\n".join(lines)
    assert lines[0].startswith(f"draft.states {mode}: ")
    assert "extract.tokens_per_second" in text and "draft.epochs" in text
    assert "draft.tokens_per_second_per_rank" in text
    assert f"{c.prefill_hours_total:.2f}" in text
    assert c.as_dict()["lines"] == lines
    if mode == "stream":
        assert "0 bytes of states on disk" in lines[0]
        assert "the engine (2,300 tok/s prefilled, 1,150 loss-masked) is slower" in lines[1]
        assert "training runs at about 1,150 loss-masked tok/s" in lines[1]
    if mode == "cached":
        assert "20.00 GiB of states on disk (draft.cache_bytes" in lines[0]
        assert lines[2].startswith("later epochs: ")
    if mode == "stored":
        assert f"{c.bytes_on_disk / 2**30:.2f} GiB of states on disk" in lines[0]


def test_a_small_run_shows_its_prefill_hours_rather_than_zero():
    small = cost("stream", tokens_per_epoch=922, loss_tokens_per_epoch=400)
    assert "0.00011 prefill-hours per epoch" in small.lines()[0]  # 922 / 2,300 / 3600
    assert "0.00 prefill" not in "\n".join(small.lines())


def test_validate_env_states_the_cost_and_checks_only_the_bytes_the_mode_writes(
    fake_deepseek_v3, tmp_path
):
    import yaml
    from snakemake.utils import validate as validate_schema

    from eagleflow.extract.preflight import validate
    from eagleflow.plan.resources import TrainingTokens
    from eagleflow.plan.settings import DraftSettings
    from eagleflow.plan.stream_cost import configured_states_cost
    from support.workflow_runner import REPO

    cfg = yaml.safe_load((REPO / "config/examples/deepseek-v3-tp8.yaml").read_text())
    validate_schema(cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    epoch = TrainingTokens(90, 9_000, 4_000)
    reports = {}
    for mode in ("stored", "stream", "cached"):
        cfg["draft"]["states"], cfg["draft"]["cache_bytes"] = mode, 2**20
        ok, report = validate(
            cfg,
            str(fake_deepseek_v3),
            10_000,
            str(tmp_path / "results"),
            device_checks=False,
            states_cost=lambda per_token: configured_states_cost(
                DraftSettings.from_config(cfg), cfg["extract"], 10_000, per_token, epoch
            ),
        )
        assert ok, [c for c in report["checks"] if not c["ok"]]
        reports[mode] = report
    per_token = len(reports["stored"]["layer_ids"]) * 7168 * 2
    stored, stream, cached = (reports[m]["states_cost"] for m in ("stored", "stream", "cached"))
    assert stored["bytes_on_disk"] == reports["stored"]["output_bytes_estimate"]
    assert stored["bytes_on_disk"] == 10_000 * per_token
    assert stream["bytes_on_disk"] == 0 and cached["bytes_on_disk"] == 2**20
    assert stream["tokens_per_epoch"] == 9_000 and stream["loss_tokens_per_epoch"] == 4_000
    # deepseek-v3-tp8: 8 ranks on its 8 GPUs at draft.tokens_per_second_per_rank
    rank_rate = cfg["draft"]["tokens_per_second_per_rank"]
    assert stream["trainer_tokens_per_second"] == 8 * rank_rate
    assert stream["engine_tokens_per_second"] == cfg["extract"]["tokens_per_second"]
    assert stream["lines"][0].startswith("draft.states stream: 0 bytes")
    disk = {m: next(c for c in r["checks"] if c["name"] == "disk") for m, r in reports.items()}
    assert "draft.states stream writes none" in disk["stream"]["detail"]
    assert disk["stream"]["detail"].startswith("0.00 GiB of hidden states")
    assert "10000 tokens x 4 layers" in disk["stored"]["detail"]
    assert "at most draft.cache_bytes" in disk["cached"]["detail"]


@pytest.mark.slow
def test_progress_states_the_cost_of_the_configured_mode(tmp_path):
    from support.workflow_runner import SMALL, merged, snakemake

    snakemake(tmp_path, "progress", config=merged(SMALL, {"draft": {"states": "stream"}}))
    report = (tmp_path / "results" / "logs" / "progress.log").read_text()
    assert "draft.states stream: 0 bytes of states on disk; the target prefills" in report, report
    assert "(draft.states stored: " in report
    assert "training runs at about" in report
