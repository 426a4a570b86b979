"""Runs inside vLLM's worker processes (`LLM(worker_extension_cls=...)`).

The driver installs a wrapper around the model's forward (`eagleflow_install`), feeds the
engine continuously (`LLMEngine.add_request` / `step`) and registers each chunk's engine
request ids, lengths and expected tokens (`eagleflow_expect`). As soon as every request of a
registered chunk has all its rows, the chunk is handed to a writer thread, which places the
rows by the token positions the engine itself used, checks the engine's input ids against
the expected tokens (whole-tensor comparisons, no loop over tokens), writes the chunk's rows
into the shard file in place (`eagleflow.store.shardfile`) and then commits the chunk's marker
(temporary name, rename). So a row can never land in another request's sample, the
engine never waits for a commit, and writing overlaps the next batches' prefill. At most two
complete chunks wait for the writer (the forward blocks beyond that), so memory is bounded
by the chunk size, not the shard size.

With `storage_dtype` float8_e4m3fn in the plan, each aux state is quantized on the device
(one scale per token and layer, `eagleflow.store.quant`) before the device-to-host copy, so
that copy moves about half the bytes; the rows written are then `hidden_states` (F8_E4M3) and
`hidden_scales` (F32 [tokens, n_layers]).

Only TP rank 0 of each pipeline stage keeps states (they are replicated across TP ranks after
the all-gathers in vLLM's forward), and only the layer ids its stage owns (`CapturePlan.stages`);
it writes their columns of the rows and its own marker (`ShardChunks.path(i, stage)`); the
other ranks copy nothing. A write error surfaces on the next call.
Every error raised here carries the full worker traceback in its message.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
import traceback
from itertools import islice

from eagleflow.capture.chunk_rows import place_rows
from eagleflow.capture.plan import CapturePlan, Strategy
from eagleflow.engine.vllm_fixes import apply_vllm_fixes
from eagleflow.store.quant import is_fp8, states_to_host
from eagleflow.store.shardfile import ChunkTarget

# Worker processes build the model after importing this module (TP > 1 on the CPU).
apply_vllm_fixes()


def _surface_errors(fn):
    """Re-raise worker errors with the whole traceback in the message (never an empty string)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised with its traceback
            raise RuntimeError(
                f"eagleflow worker error in {fn.__name__}: {type(e).__name__}: {e}\n"
                f"--- worker traceback ---\n{traceback.format_exc()}"
            ) from None

    return wrapper


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _pp_group():
    from vllm.distributed import get_pp_group

    return get_pp_group()


def _allocate_intermediate_tensors(runner) -> None:
    """vLLM 0.32's CPU worker never allocates the buffer a later pipeline stage receives into:
    it is made in `_dummy_run`, which the CPU worker skips when compilation is off
    (`cpu_worker._should_warm_up_model`); the first forward then fails on
    `assert self.intermediate_tensors is not None`. Allocate it as `_dummy_run` does."""
    if getattr(runner, "intermediate_tensors", None) is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens,
            dtype=runner.model_config.dtype,
            device=runner.device,
        )


def patched_deepseek_v2_forward(inner, layer_ids, embedding_method):
    """eagleflow's replica of DeepseekV2Model.forward that also returns the residual stream
    entering each captured layer of this pipeline stage; id L = final pre-norm state (last
    stage). Layers are indexed globally, as in vLLM's forward; a stage before the last returns
    `IntermediateTensors` with its aux states."""
    from vllm.model_executor.models.deepseek_v2 import _get_llama_4_scaling
    from vllm.sequence import IntermediateTensors

    wanted = set(layer_ids)
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", len(inner.layers))
    pp = _pp_group()
    first, last = pp.is_first_rank, pp.is_last_rank

    def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if first:
            hidden = (
                inputs_embeds
                if inputs_embeds is not None
                else getattr(inner, embedding_method)(input_ids)
            )
            residual = None
        else:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        scaling_cfg = getattr(inner.config, "llama_4_scaling", None)
        scaling = None
        if scaling_cfg is not None:
            scaling = _get_llama_4_scaling(
                original_max_position_embeddings=scaling_cfg["original_max_position_embeddings"],
                scaling_beta=scaling_cfg["beta"],
                positions=positions,
            )
        aux = []
        for idx, layer in enumerate(islice(inner.layers, start, end), start=start):
            if idx in wanted:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, scaling)
        if not last:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual}), aux
        if end in wanted:
            aux.append(hidden + residual)
        hidden, _ = inner.norm(hidden, residual)
        return hidden, aux

    return forward


class CaptureExtension:
    """Mixed into vLLM's worker class; methods are called through `LLM.collective_rpc`."""

    @_surface_errors
    def eagleflow_install(self, plan_json: dict) -> dict:
        model = self.model_runner.model
        plan = CapturePlan.from_json(plan_json)
        self._ef_plan = plan
        self._ef_fp8 = is_fp8(plan.storage_dtype)
        # engine request id -> [(positions, ids, states[, scales])]
        self._ef_rows: dict[str, list] = {}
        self._ef_counts: dict[str, int] = {}  # engine request id -> rows kept so far
        self._ef_expected: list[dict] = []  # registered chunks still missing rows, in order
        self._ef_write_error: str | None = None
        pp = _pp_group()
        stage = plan.stages[pp.rank_in_group] if plan.stages else None
        self._ef_stage = stage
        # This stage's ids (all of them without a pipeline).
        self._ef_ids = tuple(stage.layer_ids) if stage else tuple(plan.layer_ids)
        self._ef_rank0 = _tp_rank() == 0 and bool(self._ef_ids)
        if not pp.is_first_rank:
            _allocate_intermediate_tensors(self.model_runner)
        # Seconds spent in device->host copies (on the forward path) and in placing and writing
        # chunk rows (on the writer thread, overlapping the next batches' prefill).
        self._ef_stats = {"d2h_copy": 0.0, "chunk_write": 0.0}
        self._ef_queue: queue.Queue = queue.Queue(maxsize=2)
        self._ef_writer = threading.Thread(
            target=self._ef_writer_loop, name="eagleflow-chunk-writer", daemon=True
        )
        self._ef_writer.start()
        layer_ids = tuple(plan.layer_ids)
        # A multimodal wrapper (Kimi-K2.5) keeps its text model under `language_model` and
        # delegates set_aux_hidden_state_layers and forward to it.
        inner = getattr(model, "language_model", model).model
        built = (getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(inner.layers)))
        if stage is not None and built != (stage.start_layer, stage.end_layer):
            raise RuntimeError(
                f"pipeline stage {stage.rank}: the model was built with layers "
                f"{built[0]}..{built[1] - 1}, the capture plan expects "
                f"{stage.start_layer}..{stage.end_layer - 1}; the plan and the engine disagree "
                "on the partition (VLLM_PP_LAYER_PARTITION?)"
            )
        info = {
            "rank0": self._ef_rank0,
            "model_class": type(model).__name__,
            "pp_rank": pp.rank_in_group,
            "layers": list(built),
            "layer_ids": list(self._ef_ids),
        }
        if plan.strategy is Strategy.EXTRACT_HIDDEN_STATES:
            # vLLM itself set the aux layers from the speculative config, and its connector writes
            # the files: nothing to wrap, only check that the engine captures the planned ids.
            found = tuple(getattr(inner, "aux_hidden_state_layers", ()))
            if found != layer_ids:
                raise RuntimeError(
                    f"extract_hidden_states: the engine captures layer ids {list(found)}, "
                    f"the plan asks for {list(layer_ids)}"
                )
            self._ef_undo = lambda: None
            return info
        if plan.strategy is Strategy.AUX_LAYERS:
            model.set_aux_hidden_state_layers(layer_ids)
            self._ef_undo = lambda: model.set_aux_hidden_state_layers(())
            inner_call = None
        else:  # Strategy.PATCHED_FORWARD
            inner_call = patched_deepseek_v2_forward(inner, self._ef_ids, plan.embedding_method)
            self._ef_undo = lambda: None
        original = model.forward

        def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
            if inner_call is not None:
                out = inner_call(input_ids, positions, intermediate_tensors, inputs_embeds)
            else:
                out = original(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            hidden, aux = out
            if self._ef_rank0:
                self._ef_keep(input_ids, positions, aux)
            return hidden

        # An instance attribute shadows the class's forward; deleting it restores vLLM's own.
        model.forward = forward
        return info

    def _ef_keep(self, input_ids, positions, aux):
        runner = self.model_runner
        num_reqs = runner.input_batch.num_reqs
        if num_reqs == 0:
            return  # warm-up / dummy run
        req_ids = runner.input_batch.req_ids[:num_reqs]
        bounds = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        n = bounds[-1]
        if len(aux) != len(self._ef_ids):
            raise RuntimeError(
                f"the model returned {len(aux)} aux states for layer ids {list(self._ef_ids)}"
            )
        t0 = time.perf_counter()
        cols = states_to_host(aux, n, self._ef_fp8)
        # copy=True because on CPU `.to("cpu")` would alias the runner's persistent buffers.
        pos = positions[:n].to("cpu", copy=True)
        ids = input_ids[:n].to("cpu", copy=True)
        self._ef_stats["d2h_copy"] += time.perf_counter() - t0
        for i, rid in enumerate(req_ids):
            a, b = bounds[i], bounds[i + 1]
            if b > a:
                row = (pos[a:b], ids[a:b], *(c[a:b] for c in cols))
                self._ef_rows.setdefault(rid, []).append(row)
                self._ef_counts[rid] = self._ef_counts.get(rid, 0) + (b - a)
        self._ef_hand_over()

    def _ef_hand_over(self):
        """Queue every registered chunk whose requests all have their rows for the writer."""
        missing = []
        for spec in self._ef_expected:
            if all(
                self._ef_counts.get(r, 0) >= n for r, n in zip(spec["requests"], spec["lengths"])
            ):
                pieces = [self._ef_rows.pop(r) for r in spec["requests"]]
                for r in spec["requests"]:
                    del self._ef_counts[r]
                self._ef_queue.put((spec, pieces))  # blocks while two chunks wait: bounded memory
            else:
                missing.append(spec)
        self._ef_expected = missing

    def _ef_writer_loop(self):
        # The writer takes only CPU the engine leaves idle: on a CPU-bound engine a writer
        # preempting one of the forward's threads stalls all of them at the next barrier. Its
        # queue is bounded, so a starved writer blocks the engine's hand-over, which idles a
        # CPU, which runs the writer: it is delayed, never stopped.
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while True:
            item = self._ef_queue.get()
            try:
                if item is None:
                    return
                if self._ef_write_error is None:  # after an error, drop chunks until it is reported
                    t0 = time.perf_counter()
                    self._ef_write_chunk(*item)
                    self._ef_stats["chunk_write"] += time.perf_counter() - t0
            except Exception:  # noqa: BLE001 - reported on the next call
                self._ef_write_error = traceback.format_exc()
            finally:
                self._ef_queue.task_done()

    def _ef_write_chunk(self, spec: dict, pieces: list) -> None:
        """Place the rows (`eagleflow.capture.chunk_rows`: views of the forward's host tensor
        where they lie in order already), check the engine's input ids, write."""
        cols, _ = place_rows(spec["requests"], spec["lengths"], pieces, spec["token_bytes"])
        # Into the shard file in place, then the marker: a chunk is committed only once its
        # rows are on disk (eagleflow.store.shardfile, eagleflow.store.chunks).
        spec["target"].commit(cols[0], cols[1] if self._ef_fp8 else None)

    def _ef_raise_write_error(self):
        if self._ef_write_error is not None:
            err, self._ef_write_error = self._ef_write_error, None
            raise RuntimeError(f"writing a chunk failed:\n{err}")

    @_surface_errors
    def eagleflow_expect(
        self,
        chunk: int,
        request_ids: list[str],
        lengths: list[int],
        token_bytes: bytes,
        targets: dict,
    ) -> int:
        """Register chunk `chunk`: the engine request ids of its samples (in order), their
        lengths, the expected tokens (int64 bytes) and where its rows go once all are in
        (`targets`: pipeline rank -> ChunkTarget JSON, for the capturing stages)."""
        self._ef_raise_write_error()
        if not self._ef_rank0:
            return 0
        target = ChunkTarget.from_json(targets[str(self._ef_stage.rank if self._ef_stage else 0)])
        if target.metadata["layer_ids"] != list(self._ef_ids):
            raise RuntimeError(
                f"chunk {chunk}: the driver sends layer ids {target.metadata['layer_ids']} to a "
                f"stage that captures {list(self._ef_ids)}"
            )
        if len(token_bytes) != 8 * sum(lengths):
            raise ValueError(
                f"chunk {chunk}: {len(token_bytes)} bytes of tokens for {sum(lengths)} tokens"
            )
        self._ef_expected.append(
            {
                "chunk": chunk,
                "requests": list(request_ids),
                "lengths": list(lengths),
                "token_bytes": token_bytes,
                "target": target,
            }
        )
        self._ef_hand_over()  # rows may already be in
        return sum(lengths)

    @_surface_errors
    def eagleflow_finish(self) -> dict:
        """Wait until every registered chunk is written; return (and reset) the worker's timings."""
        if self._ef_expected:
            spec = self._ef_expected[0]
            short = [
                r
                for r, n in zip(spec["requests"], spec["lengths"])
                if self._ef_counts.get(r, 0) < n
            ]
            raise RuntimeError(
                f"chunk {spec['chunk']}: no complete rows for requests {short[:5]} "
                f"({len(self._ef_expected)} chunks incomplete)"
            )
        self._ef_queue.join()
        self._ef_raise_write_error()
        self._ef_rows.clear()  # rows of requests no chunk claimed
        self._ef_counts.clear()
        stats, self._ef_stats = self._ef_stats, {k: 0.0 for k in self._ef_stats}
        return stats

    @_surface_errors
    def eagleflow_uninstall(self) -> None:
        self._ef_queue.put(None)
        self._ef_writer.join()
        model = self.model_runner.model
        if "forward" in vars(model):
            del model.forward
        self._ef_undo()
        self._ef_rows, self._ef_counts, self._ef_expected = {}, {}, []
        self._ef_raise_write_error()
