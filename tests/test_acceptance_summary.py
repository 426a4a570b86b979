"""The evaluation's summary figures (eagleflow.evaluate.acceptance): acceptance length when
nothing was proposed, the interval over prompts, distinct replies, and the plot."""

import pytest

from eagleflow.evaluate.acceptance import (
    al_interval,
    distinct_replies,
    per_prompt_summary,
    plot,
    summarize,
)


def test_no_proposals_is_acceptance_length_one():
    s = summarize({"num_drafts": 0, "num_accepted_tokens": 0}, 3)
    assert s["acceptance_length"] == 1.0 and s["acceptance_rate_per_pos"] == [0.0, 0.0, 0.0]
    iv = al_interval([0, 0, 0], [0, 0, 0])
    assert iv["low"] == iv["high"] == 1.0 and iv["per_prompt_al_mean"] == 1.0
    assert iv["draft_steps"] == 0


def test_interval_brackets_the_acceptance_length_and_shrinks_with_prompts():
    drafts, accepted = [4, 5, 3, 6, 4, 2, 5, 4], [6, 2, 5, 9, 1, 4, 7, 3]
    al = 1 + sum(accepted) / sum(drafts)
    iv = al_interval(drafts, accepted)
    assert iv["prompts"] == 8 and iv["draft_steps"] == sum(drafts)
    assert iv["low"] < al < iv["high"]
    assert iv == al_interval(drafts, accepted)  # seeded
    wide = iv["half_width"]
    many = al_interval(drafts * 16, accepted * 16)
    # 16x the prompts: about a quarter of the half-width
    assert many["half_width"] == pytest.approx(wide / 4, rel=0.35)
    assert iv["prompts_for_half_width_0.1"] == pytest.approx(8 * (wide / 0.1) ** 2, abs=1)
    same = al_interval([3] * 10, [6] * 10)
    assert same["low"] == same["high"] == 3.0 and same["per_prompt_al_sd"] == 0


def test_distinct_replies_and_per_prompt_summary():
    d = distinct_replies([[1, 2], [1, 2], [3], [4, 5]])
    assert d == {"prompts": 4, "different": 3, "unique": 2}
    r = {"per_prompt": {"drafts": [2, 0], "accepted": [2, 0]}, "output_token_ids": [[1], [2]]}
    per_prompt_summary(r)
    assert r["prompts"] == 2 and r["interval"]["draft_steps"] == 2
    assert r["distinct_replies"]["unique"] == 2


def test_plot_draws_a_path_that_proposed_nothing(tmp_path, monkeypatch):
    """A path with no drafts (acceptance length 1.0) gets its bar; a failed one is named."""
    import matplotlib.axes

    bars = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "bar",
        lambda self, x, h, *a, **k: (
            bars.append((list(x), list(h))) or real_bar(self, x, h, *a, **k)
        ),
    )
    ngram = summarize({"num_drafts": 0}, 3)
    ngram.update(prompts=5, interval=al_interval([0] * 5, [0] * 5))
    eagle = summarize({"num_drafts": 4, "num_accepted_tokens": 6}, 3)
    eagle.update(prompts=5, interval=al_interval([1, 1, 1, 1, 0], [2, 1, 2, 1, 0]))
    results = {"vllm_eagle3": eagle, "vllm_ngram": ngram, "reference": {"error": "exit 1"}}
    plot(results, 3, tmp_path / "acc.png")
    assert bars == [(["vllm_eagle3", "vllm_ngram"], [2.5, 1.0])]
    assert (tmp_path / "acc.png").stat().st_size > 1000


def test_counter_difference_gives_one_prompts_counters():
    from eagleflow.evaluate.spec_decode_check import counter_difference

    before = {"num_drafts": 3, "num_accepted_tokens_per_pos": [2, 1, 0]}
    after = {"num_drafts": 5, "num_accepted_tokens": 4, "num_accepted_tokens_per_pos": [3, 2, 1]}
    assert counter_difference(after, before) == {
        "num_drafts": 2,
        "num_accepted_tokens": 4,
        "num_accepted_tokens_per_pos": [1, 1, 1],
    }
