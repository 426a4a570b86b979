"""The `extract_hidden_states` strategy: vLLM's own hidden-state extraction.

vLLM (0.32 read here) runs a speculative "proposer" (`method: extract_hidden_states`) that
receives the target's aux hidden states of every scheduled token (the model's own EAGLE-3
interface, `set_aux_hidden_state_layers(eagle_aux_hidden_state_layer_ids)`, so the ids are
vLLM's convention: id k = residual stream entering layer k, id L = final pre-norm state) and
stores them in the KV cache of a cache-only attention layer (`num_heads` = number of ids,
`head_size` = hidden size). When a request finishes, `ExampleHiddenStatesConnector` reads
the request's blocks back (`extract_from_kv_cache`: [T, n_layers, H] in the KV cache dtype),
copies them to pinned host memory on a CUDA stream and writes, on TP rank 0 only,
`{shared_storage_path}/{engine request id}.safetensors` with

    hidden_states  [T, n_layers, H]   (KV cache dtype = model dtype)
    token_ids      [T] int64          (the prompt tokens)

guarded by `{file}.lock`, held exclusively until the write is done (`load_hidden_states` takes a
shared lock, so a reader sleeps until then). The request's output carries the file in
`kv_transfer_params["hidden_states_path"]`.

eagleflow writes those per-request files' rows into its shard file and commits the chunk, as
the worker-side strategies do (`eagleflow.store.shardfile.ChunkTarget`), checking every
request's tokens against the sample's, so the shard files are identical in keys, dtypes and
layout whatever the strategy. With `storage_dtype` float8_e4m3fn in the plan, the states are
quantized here (on the host: the connector has already copied them there) into
`hidden_states` (F8_E4M3) and `hidden_scales`, as the worker-side strategies do on the device.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagleflow.capture.plan import CONNECTOR, CapturePlan, Strategy
from eagleflow.store.chunks import ShardChunks
from eagleflow.store.quant import is_fp8, quantize
from eagleflow.store.shardfile import ChunkTarget

FILE_KEYS = ("hidden_states", "token_ids")


class ConnectorFileError(RuntimeError):
    pass


def engine_kwargs(
    plan: CapturePlan,
    storage_dir: str | Path,
    connector: str = CONNECTOR,
    connector_module_path: str | None = None,
) -> dict:
    """What `LLM(...)` needs for the strategy: the speculative method with the planned layer ids,
    the hidden-states connector writing into `storage_dir`, and every prompt token computed in
    one forward (chunked prefill off; prefix caching off: a cached prefix has no states)."""
    kv = {
        "kv_connector": connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": str(storage_dir),
            # The lock makes `read_request_file` wait for a write still in flight.
            "use_synchronization_lock": True,
        },
    }
    if connector_module_path is not None:
        kv["kv_connector_module_path"] = connector_module_path
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": list(plan.layer_ids)}
            },
        },
        "kv_transfer_config": kv,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
    }


def strategy_engine_kwargs(plan: CapturePlan, storage_dir: str | Path) -> dict:
    """Extra `LLM(...)` settings of the plan's strategy (none but for extract_hidden_states)."""
    return (
        engine_kwargs(plan, storage_dir) if plan.strategy is Strategy.EXTRACT_HIDDEN_STATES else {}
    )


def read_request_file(path: str | Path) -> dict[str, torch.Tensor]:
    """One connector file, waiting (shared flock on `{path}.lock`) for a write still in flight,
    as vLLM's own `load_hidden_states` does."""
    path = str(path)
    lock = path + ".lock"
    if not os.path.exists(path) and not os.path.exists(lock):
        raise ConnectorFileError(
            f"{path}: the hidden-states connector wrote no file (nor its lock) for this request"
        )
    if os.path.exists(lock):
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
            return load_file(path, device="cpu")
    return load_file(path, device="cpu")


def _written(path: str) -> bool:
    """Whether the connector has finished writing `path` (its lock released), without blocking."""
    if not os.path.exists(path):
        return False
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def wait_for_files(llm, paths: list[str], timeout_s: float = 600.0) -> None:
    """Wait until the connector has written every file in `paths`.

    The connector writes a request's file in the engine step after the request finished
    (`get_finished`), so an engine that runs in this process (TP=1: no engine-core process) is
    stepped here; an engine-core process steps on its own while requests await their writes."""
    import time

    from vllm.v1.engine.core_client import InprocClient

    inproc = isinstance(llm.llm_engine.engine_core, InprocClient)
    deadline = time.monotonic() + timeout_s
    pending = [str(p) for p in paths]
    while True:
        pending = [p for p in pending if not _written(p)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ConnectorFileError(
                f"{len(pending)} hidden-states files not written after {timeout_s:.0f} s, "
                f"e.g. {pending[0]}"
            )
        if inproc:
            llm.llm_engine.step()
        else:
            time.sleep(0.01)


def remove_request_file(path: str | Path) -> None:
    for p in (str(path), str(path) + ".lock"):
        if os.path.exists(p):
            os.remove(p)


def request_states(
    path: str | Path, want_ids: list[int], n_layers: int, hidden_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """[T, n_layers, H] of one request, checked against the sample's tokens and the plan."""
    data = read_request_file(path)
    missing = [k for k in FILE_KEYS if k not in data]
    if missing:
        raise ConnectorFileError(
            f"{path}: keys {sorted(data)}, lacks {missing}; the installed vLLM's "
            f"{CONNECTOR} writes another format than eagleflow reads (vLLM 0.32)"
        )
    hs, ids = data["hidden_states"], data["token_ids"]
    if hs.dim() != 3 or tuple(hs.shape[1:]) != (n_layers, hidden_size):
        raise ConnectorFileError(
            f"{path}: hidden_states has shape {list(hs.shape)}, expected "
            f"[tokens, {n_layers}, {hidden_size}] for the planned layer ids"
        )
    if hs.shape[0] != ids.shape[0]:
        raise ConnectorFileError(
            f"{path}: {hs.shape[0]} rows of hidden states for {ids.shape[0]} token ids"
        )
    if ids.tolist() != list(want_ids):
        raise ConnectorFileError(
            f"{path}: the connector's token ids differ from the sample's tokens "
            f"({ids.shape[0]} vs {len(want_ids)} tokens)"
        )
    if hs.dtype != dtype:
        raise ConnectorFileError(
            f"{path}: hidden_states are {hs.dtype}, the engine's dtype is {dtype}"
        )
    return hs


def commit_from_connector(
    outputs,
    prompts: list[list[int]],
    plan: CapturePlan,
    dtype: torch.dtype,
    target: ChunkTarget,
) -> int:
    """Commit one chunk from the connector files of `outputs` (`LLM.generate`'s results, in
    prompt order) into the shard file, as the worker-side strategies do (`ChunkTarget`)."""
    parts = []
    for out, want in zip(outputs, prompts, strict=True):
        params = getattr(out, "kv_transfer_params", None) or {}
        file = params.get("hidden_states_path")
        if file is None:
            raise ConnectorFileError(
                f"request {out.request_id}: no hidden_states_path in its kv_transfer_params "
                f"({params}); "
                f"the engine was not started with {CONNECTOR} (capture.strategy "
                "extract_hidden_states)"
            )
        # The connector names the file after the engine's request id, "<output id>-<suffix>".
        if not Path(file).name.startswith(f"{out.request_id}-"):
            raise ConnectorFileError(
                f"request {out.request_id}: its hidden states file {file} is another request's"
            )
        parts.append(request_states(file, want, len(plan.layer_ids), plan.hidden_size, dtype))
    hidden = torch.cat(parts).contiguous()
    if is_fp8(plan.storage_dtype):
        target.commit(*quantize(hidden))
    else:
        target.commit(hidden, None)
    for out in outputs:
        remove_request_file(out.kv_transfer_params["hidden_states_path"])
    return int(hidden.shape[0])


def run_connector_chunks(
    llm, chunks: ShardChunks, todo: list[int], plan: CapturePlan, timings, targets
):
    """Prefill the chunks in `todo` one `generate` call each and commit the connector's files
    of each chunk into the shard file (`targets(i)`: chunk i's ChunkTarget): the
    extract_hidden_states counterpart of extraction's loop, whose rows come from vLLM's files,
    not from eagleflow's worker hooks."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    dtype = llm.llm_engine.model_config.dtype
    done = 0
    for i in todo:
        a, b = chunks.ranges[i]
        prompts = [chunks.shard.sample(j)[0].tolist() for j in range(a, b)]
        with timings.phase("prefill_and_capture"):
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
            )
        with timings.phase("commit_wait"):
            files = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]
            wait_for_files(llm, [f for f in files if f])
            done += commit_from_connector(outputs, prompts, plan, dtype, targets(i))
    return done
