"""Runs inside vLLM's worker processes (`LLM(worker_extension_cls=...)`).

The driver installs a wrapper around the model's forward (`eagleflow_install`), runs prefill
through the public `LLM.generate`, then asks the worker to commit the captured rows of the
finished requests as one chunk file (`eagleflow_commit`). Rows are keyed by request and
placed by the token positions the engine itself used, and the engine's own input ids are
checked against the expected tokens, so a row can never land in another request's sample.

Only TP rank 0 keeps states (they are replicated across TP ranks after the all-gathers in
vLLM's forward). Chunk files are written by a background thread so serialization and disk
writes overlap the next chunk's prefill; a write error surfaces on the next call.
Every error raised here carries the full worker traceback in its message.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import traceback
from itertools import islice

import torch
from safetensors.torch import save_file


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


def patched_deepseek_v2_forward(inner, layer_ids, embedding_method):
    """eagleflow's replica of DeepseekV2Model.forward (single pipeline stage) that also
    returns the residual stream entering each captured layer; id L = final pre-norm state."""
    from vllm.model_executor.models.deepseek_v2 import _get_llama_4_scaling

    wanted = set(layer_ids)
    num_layers = len(inner.layers)

    def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if intermediate_tensors is not None:
            raise NotImplementedError("patched_forward supports one pipeline stage only")
        hidden = inputs_embeds if inputs_embeds is not None else getattr(inner, embedding_method)(input_ids)
        residual = None
        scaling_cfg = getattr(inner.config, "llama_4_scaling", None)
        scaling = None
        if scaling_cfg is not None:
            scaling = _get_llama_4_scaling(
                original_max_position_embeddings=scaling_cfg["original_max_position_embeddings"],
                scaling_beta=scaling_cfg["beta"],
                positions=positions,
            )
        aux = []
        for idx, layer in enumerate(islice(inner.layers, 0, num_layers)):
            if idx in wanted:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, scaling)
        if num_layers in wanted:
            aux.append(hidden + residual)
        hidden, _ = inner.norm(hidden, residual)
        return hidden, aux

    return forward


class CaptureExtension:
    """Mixed into vLLM's worker class; methods are called through `LLM.collective_rpc`."""

    @_surface_errors
    def eagleflow_install(self, plan: dict) -> dict:
        model = self.model_runner.model
        self._ef_plan = plan
        self._ef_rows: dict[str, list] = {}
        self._ef_writer: threading.Thread | None = None
        self._ef_write_error: str | None = None
        self._ef_rank0 = _tp_rank() == 0
        # Seconds spent in device->host copies (on the forward path) and in writing chunk files
        # (on the writer thread, overlapping the next chunk's prefill).
        self._ef_stats = {"d2h_copy": 0.0, "chunk_write": 0.0}
        layer_ids = tuple(plan["layer_ids"])
        inner = model.model
        if plan["strategy"] == "extract_hidden_states":
            # vLLM itself set the aux layers from the speculative config, and its connector writes
            # the files: nothing to wrap, only check that the engine captures the planned ids.
            found = tuple(getattr(inner, "aux_hidden_state_layers", ()))
            if found != layer_ids:
                raise RuntimeError(f"extract_hidden_states: the engine captures layer ids {list(found)}, "
                                   f"the plan asks for {list(layer_ids)}")
            self._ef_undo = lambda: None
            return {"rank0": self._ef_rank0, "model_class": type(model).__name__}
        if plan["strategy"] == "aux_layers":
            model.set_aux_hidden_state_layers(layer_ids)
            self._ef_undo = lambda: model.set_aux_hidden_state_layers(())
            inner_call = None
        elif plan["strategy"] == "patched_forward":
            inner_call = patched_deepseek_v2_forward(inner, layer_ids, plan["embedding_method"])
            self._ef_undo = lambda: None
        else:
            raise ValueError(f"unknown capture strategy {plan['strategy']!r}")
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
        return {"rank0": self._ef_rank0, "model_class": type(model).__name__}

    def _ef_keep(self, input_ids, positions, aux):
        runner = self.model_runner
        num_reqs = runner.input_batch.num_reqs
        if num_reqs == 0:
            return  # warm-up / dummy run
        req_ids = runner.input_batch.req_ids[:num_reqs]
        bounds = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        n = bounds[-1]
        if len(aux) != len(self._ef_plan["layer_ids"]):
            raise RuntimeError(f"the model returned {len(aux)} aux states for layer ids {self._ef_plan['layer_ids']}")
        t0 = time.perf_counter()
        # One device->host copy per forward: [n_tokens, n_layers, hidden]. copy=True because
        # on CPU `.to("cpu")` would alias the runner's persistent input buffers.
        states = torch.stack([a[:n] for a in aux], dim=1).to("cpu")
        pos = positions[:n].to("cpu", copy=True)
        ids = input_ids[:n].to("cpu", copy=True)
        self._ef_stats["d2h_copy"] += time.perf_counter() - t0
        for i, rid in enumerate(req_ids):
            a, b = bounds[i], bounds[i + 1]
            if b > a:
                self._ef_rows.setdefault(rid, []).append((pos[a:b], ids[a:b], states[a:b]))

    def _ef_wait_writer(self):
        if self._ef_writer is not None:
            self._ef_writer.join()
            self._ef_writer = None
        if self._ef_write_error is not None:
            err, self._ef_write_error = self._ef_write_error, None
            raise RuntimeError(f"writing a chunk failed:\n{err}")

    @_surface_errors
    def eagleflow_commit(self, request_ids: list[str], expected_ids: list[list[int]], path: str,
                         metadata: dict) -> int:
        """Assemble the rows of `request_ids` (in that order) and write them to `path`."""
        if not self._ef_rank0:
            self._ef_rows.clear()
            return 0
        self._ef_wait_writer()
        engine_ids = {}
        for rid in self._ef_rows:
            # Engine request ids carry a suffix ("7-b8b8dadd") that LLM outputs do not ("7").
            engine_ids.setdefault(rid.split("-")[0], []).append(rid)
        parts, captured_ids = [], []
        for rid, want in zip(request_ids, expected_ids):
            matches = engine_ids.get(rid, [])
            if len(matches) != 1:
                raise RuntimeError(f"request {rid}: expected one engine request with captured rows, found {matches}")
            pieces = self._ef_rows.pop(matches[0])
            pos = torch.cat([p for p, _, _ in pieces])
            ids = torch.cat([t for _, t, _ in pieces])
            states = torch.cat([s for _, _, s in pieces])
            keep = pos < len(want)  # drop any decode step scheduled past the prompt
            pos, ids, states = pos[keep], ids[keep], states[keep]
            order = torch.argsort(pos)
            pos, ids, states = pos[order], ids[order], states[order]
            if not torch.equal(pos, torch.arange(len(want), dtype=pos.dtype)):
                raise RuntimeError(
                    f"request {rid}: captured positions do not cover 0..{len(want) - 1} exactly once "
                    f"(got {len(pos)} rows; prefix caching must be off)"
                )
            if ids.tolist() != want:
                raise RuntimeError(f"request {rid}: the engine's input ids differ from the sample's tokens")
            parts.append(states)
            captured_ids.append(ids)
        self._ef_rows.clear()
        hidden = torch.cat(parts).contiguous()
        input_ids = torch.cat(captured_ids).to(torch.int64)

        def write():
            t0 = time.perf_counter()
            try:
                tmp = path + ".tmp"
                save_file({"hidden_states": hidden, "input_ids": input_ids}, tmp,
                          metadata={k: json.dumps(v) for k, v in metadata.items()})
                os.replace(tmp, path)
            except Exception:  # noqa: BLE001 - reported on the next call
                self._ef_write_error = traceback.format_exc()
            self._ef_stats["chunk_write"] += time.perf_counter() - t0

        self._ef_writer = threading.Thread(target=write, name="eagleflow-chunk-writer")
        self._ef_writer.start()
        return int(hidden.shape[0])

    @_surface_errors
    def eagleflow_finish(self) -> dict:
        """Wait for the last chunk write; return (and reset) the worker's timings."""
        self._ef_wait_writer()
        stats, self._ef_stats = self._ef_stats, {k: 0.0 for k in self._ef_stats}
        return stats

    @_surface_errors
    def eagleflow_uninstall(self) -> None:
        self._ef_wait_writer()
        model = self.model_runner.model
        if "forward" in vars(model):
            del model.forward
        self._ef_undo()
        self._ef_rows = {}
