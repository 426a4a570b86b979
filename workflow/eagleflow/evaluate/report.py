"""The evaluation's report a user can paste beside a published card: `acceptance.md` (a table
of set x mode x k, with engine, k, temperature, target and draft; with a reasoning parser, the
acceptance length of the reasoning and of the answer) and the plot of acceptance length against
k, both from `acceptance.json` (`eagleflow.evaluate.acceptance.evaluate`).

A column of the tables is a set, or with `evaluate.modes` a set in one mode (`heldout
(thinking)`): the modes' figures are `runs_by_mode` in the JSON."""

from __future__ import annotations

DEFINITION = (
    "AL (acceptance length) = 1 + accepted draft tokens / draft steps, the bonus token "
    "counted, from vLLM's spec-decode metrics (`vllm:spec_decode_num_accepted_tokens` / "
    "`vllm:spec_decode_num_drafts`); the reference loop counts the same way. How it maps to "
    "SGLang's `accept_length` and to speculators' and SpecForge's figures: docs/evaluation.md."
)
PATH_NAMES = {
    "vllm_eagle3": "vLLM eagle3",
    "vllm_ngram": "vLLM n-gram (baseline)",
    "reference": "reference loop (transformers)",
}


def path_label(path: str) -> str:
    base, _, rest = path.partition(" ")
    return PATH_NAMES.get(base, base) + (f" {rest}" if rest else "")


def sampling_label(report: dict) -> str:
    t = float(report.get("temperature", 0.0))
    return "0 (greedy)" if t == 0 else f"{t:g}, seed {report.get('seed', 0)}"


def _al(r: dict) -> str:
    if r is None:
        return "-"
    if r.get("error"):
        return "failed"
    return f"{r['acceptance_length']:.2f}"


def _interval(r: dict) -> str:
    iv = (r or {}).get("interval") or {}
    return f"[{iv['low']:.2f}, {iv['high']:.2f}]" if "low" in iv else "-"


# What vLLM 0.32 serves each `draft.architecture` as.
DRAFT_MODELS = {
    "llama": "vLLM's Eagle3LlamaForCausalLM, speculators format",
    "mla": "vLLM's Eagle3DeepseekV2ForCausalLM",
}


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def columns(report: dict) -> list[tuple[str, str, dict]]:
    """(label, set, {k: {path: figures}}) of every set, or of every set in every mode."""
    by_mode = report.get("runs_by_mode") or {"": report["runs"]}
    return [
        (f"{s} ({mode})" if mode else s, s, by_mode[mode][s])
        for s in report["sets"]
        for mode in by_mode
    ]


def _kwargs(kwargs: dict) -> str:
    return (
        "{"
        + ", ".join(
            f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in kwargs.items()
        )
        + "}"
    )


def acceptance_markdown(report: dict) -> str:
    """The Markdown of `acceptance.md`."""
    ks, cols = [str(k) for k in report["ks"]], columns(report)
    paths = list(dict.fromkeys(p for _, _, by_k in cols for r in by_k.values() for p in r))
    temp = sampling_label(report)
    lines = ["# Acceptance length", "", "| | |", "|---|---|"]
    lines.append(_row(["target", f"`{report['target']}`"]))
    lines.append(_row(["draft", f"`{report['draft']}` (this run's export)"]))
    if report.get("draft_architecture"):
        served = DRAFT_MODELS[report["draft_architecture"]]
        lines.append(_row(["draft architecture", f"{report['draft_architecture']} ({served})"]))
    if report.get("given_draft"):
        lines.append(_row(["draft (evaluate.draft)", f"`{report['given_draft']}`"]))
    lines.append(_row(["engine", report.get("engine", "vLLM")]))
    lines.append(_row(["temperature", temp]))
    lines.append(_row(["tokens per turn", f"at most {report['max_tokens']}"]))
    lines.append(_row(["engine loads", report.get("engine_loads", "-")]))
    for name, info in report["sets"].items():
        lines.append(
            _row(
                [
                    f"set `{name}`",
                    f"{info['format']}, `{info['path']}`, {info['prompts']} prompts, "
                    f"{info['turns']} turns",
                ]
            )
        )
    for mode, kwargs in (report.get("modes") or {}).items():
        lines.append(_row([f"mode `{mode}`", f"chat template `{_kwargs(kwargs)}`"]))
    if report.get("reasoning_parser"):
        lines.append(
            _row(["reasoning and answer", f"split by vLLM's `{report['reasoning_parser']}` parser"])
        )
    if "cpu" in str(report.get("engine", "")).lower():
        lines.append(_row(["note", "a CPU engine: speed figures, if any, are not representative"]))
    lines += ["", DEFINITION, "", "## As published cards report it", ""]
    lines.append(_row(["engine", "k", "temperature"] + [label for label, _, _ in cols]))
    lines.append(_row(["---"] * (3 + len(cols))))
    for path in paths:
        for k in ks:
            cells = [_al(by_k.get(k, {}).get(path)) for _, _, by_k in cols]
            lines.append(_row([path_label(path), k, temp] + cells))
    lines += ["", "## Every figure", ""]
    head = ["set", "category", "engine", "k", "temperature", "AL", "95% interval"]
    head += ["prompts", "drafts", "accepted per position"]
    lines.append(_row(head))
    lines.append(_row(["---"] * len(head)))
    for s, _, by_k in cols:
        for k in ks:
            for path in paths:
                r = by_k.get(k, {}).get(path)
                if r is None:
                    continue
                rows = [("all", r)] + list((r.get("by_category") or {}).items())
                for cat, fig in rows:
                    if fig.get("error"):
                        lines.append(
                            _row([s, cat, path_label(path), k, temp, "failed"] + ["-"] * 4)
                        )
                        continue
                    per_pos = ", ".join(str(x) for x in fig["num_accepted_tokens_per_pos"])
                    lines.append(
                        _row(
                            [s, cat, path_label(path), k, temp, _al(fig), _interval(fig)]
                            + [fig.get("prompts", "-"), fig["num_drafts"], per_pos]
                        )
                    )
    lines += parts_markdown(cols, ks, paths, temp)
    skipped = {
        s: max((r.get("turns_skipped", 0) for v in by_k.values() for r in v.values()), default=0)
        for s, _, by_k in cols
    }
    if any(skipped.values()):
        lines += [
            "",
            "Turns whose prompt is longer than `data.max_length` are not generated (never cut): "
            + ", ".join(f"{s}: {n}" for s, n in skipped.items() if n)
            + ".",
        ]
    lines += speed_markdown(report.get("speed"), temp)
    return "\n".join(lines) + "\n"


def parts_markdown(cols, ks, paths, temp: str) -> list[str]:
    """Acceptance length of the reasoning and of the answer, where replies were split."""
    rows = []
    for label, _, by_k in cols:
        for k in ks:
            for path in paths:
                r = by_k.get(k, {}).get(path) or {}
                parts = r.get("by_part")
                if not parts:
                    continue
                reasoning, answer = parts["reasoning"], parts["answer"]
                rows.append(
                    _row(
                        [label, path_label(path), k, temp, _al(r)]
                        + [_al(x) if x["num_drafts"] else "-" for x in (reasoning, answer)]
                        + [reasoning["num_drafts"], answer["num_drafts"]]
                    )
                )
    if not rows:
        return []
    head = ["set", "engine", "k", "temperature", "AL", "AL reasoning", "AL answer"]
    head += ["drafts reasoning", "drafts answer"]
    return [
        "",
        "## Reasoning and answer",
        "",
        "Each reply generated in two requests, split where vLLM's reasoning parser says the "
        "reasoning ends (docs/evaluation.md); a mode whose prompt closes the reasoning is all "
        "answer.",
        "",
        _row(head),
        _row(["---"] * len(head)),
        *rows,
    ]


def speed_markdown(speed: dict | None, temp: str) -> list[str]:
    """The speed-up section: output tokens/s with and without the draft per concurrency."""
    if not speed:
        return []
    lines = ["", "## Speed-up (output tokens/s, the same prompts and engine settings)", ""]
    if not speed.get("representative", True):
        lines += [f"**{speed['note']}.**", ""]
    head = ["engine", "k", "temperature", "concurrency", "target alone", "with draft", "ratio"]
    lines += [_row(head), _row(["---"] * len(head))]
    for r in speed["rows"]:
        alone = r["target_alone_tokens_per_second"]
        ratio = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(
            _row(
                [path_label(r["path"]), r["k"], temp, r["concurrency"]]
                + [alone if alone is not None else "failed", r["tokens_per_second"], ratio]
            )
        )
    return lines


def plot_sweep(report: dict, path) -> None:
    """One panel per set: acceptance length against k for every path, with the 95% interval;
    a last panel of the per-position acceptance rates of the first set at the largest k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks, cols = report["ks"], columns(report)
    fig, axes = plt.subplots(1, len(cols) + 1, figsize=(4.5 * (len(cols) + 1), 4), squeeze=False)
    temp = sampling_label(report)
    for ax, (label, s, by_k) in zip(axes[0], cols):
        paths = list(dict.fromkeys(p for r in by_k.values() for p in r))
        for p in paths:
            xs, ys, lo, hi = [], [], [], []
            for k in ks:
                r = by_k.get(str(k), {}).get(p) or {}
                if r.get("acceptance_length") is None:
                    continue
                iv = r.get("interval") or {}
                xs.append(k)
                ys.append(r["acceptance_length"])
                lo.append(max(0.0, ys[-1] - iv.get("low", ys[-1])))
                hi.append(max(0.0, iv.get("high", ys[-1]) - ys[-1]))
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, label=path_label(p))
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(
            title=f"{label}: {report['sets'][s]['prompts']} prompts",
            xlabel="k (speculative tokens)",
            ylabel="acceptance length",
            xticks=ks,
            ylim=(0, max(ks) + 1),
        )
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    label, _, by_k = cols[0]
    first = by_k.get(str(max(ks)), {})
    for p, r in first.items():
        if r.get("acceptance_rate_per_pos"):
            n = len(r["acceptance_rate_per_pos"])
            ax.plot(range(1, n + 1), r["acceptance_rate_per_pos"], marker="o", label=path_label(p))
    ax.set(
        title=f"{label}, k={max(ks)}: per position",
        xlabel="draft position",
        ylabel="accepted / drafts",
        ylim=(0, 1),
    )
    ax.legend(fontsize=7)
    fig.suptitle(f"temperature {temp}; 95% bootstrap interval over prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
