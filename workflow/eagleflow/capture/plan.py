"""The capture plan: how hidden states are taken out of the installed vLLM, checked before
any weights load.

Strategies:
- `aux_layers`: the model's own EAGLE-3 interface (`set_aux_hidden_state_layers`; the model
  then returns `(hidden, [aux...])`). The states are exactly what vLLM feeds an EAGLE-3 draft
  at serving time.
- `patched_forward`: for DeepseekV2-family models on vLLM versions without that interface,
  eagleflow's own replica of the inner model's forward: the embedding method that exists,
  decoder layers called positionally as vLLM calls them, the residual stream summed before
  each captured layer.
- `extract_hidden_states`: vLLM's own extraction (a speculative "proposer" that stores the
  model's aux states in a cache-only KV layer, and `ExampleHiddenStatesConnector`, which writes
  one file per request; eagleflow converts those files: `eagleflow.capture.connector`). Only
  where it works: CUDA (the connector copies through pinned memory on a CUDA stream), non-MLA
  targets, the vLLM versions whose source eagleflow has read. Never chosen by `auto`.

Pipeline parallelism: each stage runs the decoder layers [start_layer, end_layer) that the
installed vLLM assigns it (`vllm.distributed.utils.get_pp_indices`, which honours
`VLLM_PP_LAYER_PARTITION`), and captures the ids it owns: id k (the residual stream entering
layer k) belongs to the stage running layer k, and id L (the final pre-norm state) to the last
stage. The plan records the stages (`Stage`); the workers check them against the layers their
model was built with. vLLM 0.32's stages before the last return `IntermediateTensors` without
their aux states, so with PP > 1 `auto` picks `patched_forward` (which keeps them) and
`aux_layers` is refused where the installed forward drops them.

Every strategy lists what it depends on in the installed code; `check_plan` verifies each
item (methods exist, signatures match by parameter names and order) and fails with one
message naming the vLLM version, the class, what was expected and what was found.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

from eagleflow.engine.version import vllm_version
from eagleflow.store.quant import DEFAULT_STORAGE, check_storage_dtype
from eagleflow.target.info import TargetInfo
from eagleflow.target.layers import CONVENTION, CONVENTION_TEXT


@dataclass(frozen=True)
class ArchSpec:
    module: str
    model_cls: str
    inner_cls: str
    layer_cls: str
    # The decoder-layer call vLLM's own forward makes, by parameter name and order.
    layer_params: tuple[str, ...]
    # Whether the inner forward can capture id 0 (residual stream before layer 0).
    aux_captures_embeddings: bool


ARCHITECTURES = {
    "DeepseekV3ForCausalLM": ArchSpec(
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV3ForCausalLM",
        "DeepseekV2Model",
        "DeepseekV2DecoderLayer",
        ("positions", "hidden_states", "residual", "llama_4_scaling"),
        False,
    ),
    "DeepseekV2ForCausalLM": ArchSpec(
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Model",
        "DeepseekV2DecoderLayer",
        ("positions", "hidden_states", "residual", "llama_4_scaling"),
        False,
    ),
    "LlamaForCausalLM": ArchSpec(
        "vllm.model_executor.models.llama",
        "LlamaForCausalLM",
        "LlamaModel",
        "LlamaDecoderLayer",
        ("positions", "hidden_states", "residual"),
        True,
    ),
    "Qwen3ForCausalLM": ArchSpec(
        "vllm.model_executor.models.qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Model",
        "Qwen3DecoderLayer",
        ("positions", "hidden_states", "residual"),
        True,
    ),
}

# Multimodal wrappers vLLM loads around a text model of the table above (config under
# `text_config`): the wrapper must hand the text model's aux interface and forward through.
WRAPPER_CLASSES = {
    "KimiK25ForConditionalGeneration": (
        "vllm.model_executor.models.kimi_k25",
        "KimiK25ForConditionalGeneration",
    ),
}


class Strategy(str, Enum):
    """How hidden states leave the engine (module docstring)."""

    AUX_LAYERS = "aux_layers"
    PATCHED_FORWARD = "patched_forward"
    EXTRACT_HIDDEN_STATES = "extract_hidden_states"


STRATEGIES = tuple(s.value for s in Strategy)

# vLLM versions whose extract_hidden_states proposer and hidden-states connector eagleflow has read
# (file keys and layout, single-rank finish count, HiddenStateCacheSpec): [min, max).
EXTRACT_HIDDEN_STATES_VERSIONS = ("0.32", "0.33")


# vLLM's own extraction (the extract_hidden_states strategy; eagleflow.capture.connector).
CONNECTOR = "ExampleHiddenStatesConnector"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
PROPOSER_MODULE = "vllm.v1.spec_decode.extract_hidden_states"


class CaptureCheckError(RuntimeError):
    pass


def _params(fn) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def _fail(cls, expected, found, todo) -> CaptureCheckError:
    return CaptureCheckError(
        f"vLLM {vllm_version()}: {cls}: expected {expected}, found {found}. {todo}"
    )


def _aux_kept_on_inner_stages(inner_src: str) -> bool:
    """Whether the inner forward's return on a stage before the last carries its aux states
    (in vLLM 0.32 it returns `IntermediateTensors({"hidden_states", "residual"})` only)."""
    if "is_last_rank" not in inner_src:
        return False
    branch = inner_src.split("is_last_rank", 1)[1].split("\n\n", 1)[0]
    return "aux" in branch


def introspect(spec: ArchSpec) -> dict:
    """What the installed vLLM offers for this architecture (imports code, loads no weights)."""
    mod = importlib.import_module(spec.module)
    model_cls = getattr(mod, spec.model_cls, None)
    inner_cls = getattr(mod, spec.inner_cls, None)
    layer_cls = getattr(mod, spec.layer_cls, None)
    for name, obj in (
        (spec.model_cls, model_cls),
        (spec.inner_cls, inner_cls),
        (spec.layer_cls, layer_cls),
    ):
        if obj is None:
            raise _fail(
                f"{spec.module}.{name}",
                "the class to exist",
                "no such class",
                "Install a vLLM version this eagleflow supports (docs/support-matrix.md).",
            )
    inner_src = inspect.getsource(inner_cls.forward)
    embed = next(
        (m for m in ("embed_input_ids", "get_input_embeddings") if hasattr(inner_cls, m)), None
    )
    return {
        "model_class": f"{spec.module}.{spec.model_cls}",
        "inner_class": f"{spec.module}.{spec.inner_cls}",
        "layer_class": f"{spec.module}.{spec.layer_cls}",
        "has_aux_interface": hasattr(model_cls, "set_aux_hidden_state_layers")
        and ("aux_hidden_state_layers" in inner_src or "_maybe_add_hidden_state" in inner_src),
        # Capturing id L (final pre-norm state) arrived in mid-2026 versions.
        "aux_captures_final": "end_layer in self.aux_hidden_state_layers" in inner_src
        or "_maybe_add_hidden_state" in inner_src,
        "aux_kept_on_inner_stages": _aux_kept_on_inner_stages(inner_src),
        "embedding_method": embed,
        "layer_call_signature": list(_params(layer_cls.forward)),
        "inner_forward_signature": list(_params(inner_cls.forward)),
    }


def introspect_extract_hidden_states() -> dict:
    """What vLLM's own extraction needs from the installed code (imports code, loads no weights)."""
    found = {
        "vllm_version": vllm_version(),
        "ehs_proposer": None,
        "ehs_connector": None,
        "ehs_connector_registered": False,
        "ehs_file_keys": [],
        "ehs_connector_needs_cuda": None,
        "ehs_single_rank_finish": False,
    }
    try:
        proposer = getattr(
            importlib.import_module(PROPOSER_MODULE), "ExtractHiddenStatesProposer", None
        )
        conn_mod = importlib.import_module(CONNECTOR_MODULE)
    except ImportError:
        return found
    conn = getattr(conn_mod, CONNECTOR, None)
    if proposer is not None:
        found["ehs_proposer"] = f"{PROPOSER_MODULE}.ExtractHiddenStatesProposer"
    if conn is None:
        return found
    found["ehs_connector"] = f"{CONNECTOR_MODULE}.{CONNECTOR}"
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        found["ehs_connector_registered"] = CONNECTOR in KVConnectorFactory._registry
    except (ImportError, AttributeError):
        pass
    write_src = (
        inspect.getsource(conn._submit_async_write) if hasattr(conn, "_submit_async_write") else ""
    )
    found["ehs_file_keys"] = [k for k in ("hidden_states", "token_ids") if f'"{k}"' in write_src]
    found["ehs_connector_needs_cuda"] = "pin_memory=True" in write_src or "torch.cuda" in write_src
    # Without it, TP>1 never reports a request finished (only rank 0 writes) and leaks its blocks.
    found["ehs_single_rank_finish"] = "get_finished_count" in vars(conn)
    return found


def introspect_wrapper(wrapper: str) -> dict:
    """The multimodal wrapper class vLLM instantiates for the checkpoint, checked to delegate to
    its `language_model` (eagleflow's worker captures through that text model)."""
    where = WRAPPER_CLASSES.get(wrapper)
    if where is None:
        raise CaptureCheckError(
            f"vLLM {vllm_version()}: {wrapper}: a multimodal wrapper eagleflow has no adapter for "
            f"(supported: {', '.join(sorted(WRAPPER_CLASSES))})"
        )
    module, name = where
    cls = getattr(importlib.import_module(module), name, None)
    if cls is None:
        raise _fail(
            f"{module}.{name}",
            "the class to exist",
            "no such class",
            "Install a vLLM version that serves this checkpoint (docs/support-matrix.md).",
        )
    fwd = inspect.getsource(cls.forward)
    aux = (
        inspect.getsource(cls.set_aux_hidden_state_layers)
        if hasattr(cls, "set_aux_hidden_state_layers")
        else ""
    )
    init = inspect.getsource(cls.__init__)
    checks = {
        "forward returns self.language_model(...)": "self.language_model(" in fwd,
        "set_aux_hidden_state_layers delegates to language_model": (
            "self.language_model.set_aux_hidden_state_layers" in aux
        ),
        "language_model is built from text_config": "text_config" in init
        and "self.language_model" in init,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise _fail(
            f"{module}.{name}",
            "; ".join(checks),
            "not: " + "; ".join(bad),
            "eagleflow captures through the wrapper's language_model; "
            "upgrade eagleflow for this vLLM.",
        )
    return {"wrapper_class": f"{module}.{name}", "wrapper_checks": list(checks)}


def _ehs_refusal(reason: str, todo: str) -> CaptureCheckError:
    return CaptureCheckError(
        f"vLLM {vllm_version()}: capture.strategy extract_hidden_states: {reason}. {todo}"
    )


def check_extract_hidden_states(found: dict, device: str, is_mla: bool) -> list[str]:
    """Refusals of vLLM's own extraction, each before any weights load."""
    from packaging.version import InvalidVersion, Version

    lo, hi = EXTRACT_HIDDEN_STATES_VERSIONS
    other = (
        "Use `capture.strategy: auto` "
        "(aux_layers: the same states, through the model's own EAGLE-3 interface)."
    )
    try:
        v = Version(found["vllm_version"])
        in_range = Version(lo) <= Version(v.base_version) < Version(hi)
    except InvalidVersion:
        in_range = False
    if not in_range:
        raise _ehs_refusal(
            f"eagleflow reads this strategy's files as vLLM >= {lo}, < {hi} writes them; "
            f"{found['vllm_version']} is outside that range",
            f"Install vLLM {lo}.x, or: {other}",
        )
    for key, what in (
        ("ehs_proposer", "ExtractHiddenStatesProposer (vllm.v1.spec_decode.extract_hidden_states)"),
        ("ehs_connector", "ExampleHiddenStatesConnector"),
    ):
        if not found[key]:
            raise _ehs_refusal(f"{what} is missing from the installed code", other)
    if not found["ehs_connector_registered"]:
        raise _ehs_refusal(
            "ExampleHiddenStatesConnector is not registered with KVConnectorFactory", other
        )
    if found["ehs_file_keys"] != ["hidden_states", "token_ids"]:
        raise _ehs_refusal(
            f"the connector writes keys {found['ehs_file_keys']}, eagleflow reads "
            "['hidden_states', 'token_ids']",
            other,
        )
    if not found["ehs_single_rank_finish"]:
        raise _ehs_refusal(
            "the connector lacks get_finished_count (with TP > 1 finished requests are never "
            "reported and their KV blocks leak)",
            other,
        )
    passed = [
        f"vLLM {found['vllm_version']} within [{lo}, {hi}); proposer and connector present; "
        "connector files carry hidden_states [T, n_ids, H] and token_ids [T]"
    ]
    if device != "cuda":
        raise _ehs_refusal(
            f"extract.device is {device!r}, and ExampleHiddenStatesConnector copies the states "
            "through pinned memory on a CUDA stream (on CPU vLLM 0.32 fails in "
            '_submit_async_write: "pin_memory=True requires a CUDA or other accelerator '
            'backend"); GPU only',
            other,
        )
    passed.append("device is cuda")
    if is_mla:
        raise _ehs_refusal(
            "the target uses MLA (kv_lora_rank set); the hidden-states cache layer "
            "(HiddenStateCacheSpec, an MLAAttentionSpec) cannot be isolated from MLA layers in "
            'its own KV cache group (vLLM: "MLA verifiers are unsupported"), and its KV memory '
            "is over-reserved for DeepSeek-class models (vLLM issues 53243, 56774)",
            other,
        )
    passed.append("target is not MLA")
    return passed


def choose_strategy(
    requested: str,
    found: dict,
    layer_ids: list[int],
    num_layers: int,
    spec: ArchSpec,
    pipeline_parallel_size: int = 1,
) -> Strategy:
    if requested != "auto":
        return parse_strategy(requested)
    # extract_hidden_states is never picked automatically: it is GPU-only and non-MLA, and
    # aux_layers gives the same states through the same model interface.
    if spec.inner_cls != "DeepseekV2Model":
        return Strategy.AUX_LAYERS  # the patched forward exists for the DeepseekV2 family only
    aux_ok = (
        found["has_aux_interface"]
        and (pipeline_parallel_size == 1 or found.get("aux_kept_on_inner_stages", False))
        and (spec.aux_captures_embeddings or 0 not in layer_ids)
        and (found["aux_captures_final"] or num_layers not in layer_ids)
    )
    return Strategy.AUX_LAYERS if aux_ok else Strategy.PATCHED_FORWARD


def parse_strategy(name: str) -> Strategy:
    try:
        return Strategy(name)
    except ValueError:
        raise CaptureCheckError(
            f"capture.strategy: unknown strategy {name!r}; use one of {STRATEGIES} or auto"
        ) from None


def check_plan(
    strategy: str,
    found: dict,
    layer_ids: list[int],
    num_layers: int,
    spec: ArchSpec,
    device: str = "cpu",
    is_mla: bool = False,
    pipeline_parallel_size: int = 1,
) -> list[str]:
    """Raise CaptureCheckError on the first unmet dependency; return the checks that passed."""
    strategy = parse_strategy(strategy)
    passed = []
    pp = pipeline_parallel_size
    if pp > 1 and strategy is Strategy.EXTRACT_HIDDEN_STATES:
        raise _ehs_refusal(
            f"extract.pipeline_parallel_size is {pp}, and vLLM's own extraction supports one "
            "pipeline stage only (vLLM issue 14089)",
            "Use `capture.strategy: auto`.",
        )
    if pp > 1 and strategy is Strategy.AUX_LAYERS and not found.get("aux_kept_on_inner_stages"):
        raise _fail(
            found["inner_class"] + ".forward",
            f"aux states returned by every pipeline stage (extract.pipeline_parallel_size {pp})",
            "stages before the last return IntermediateTensors without their aux states",
            "Set `capture.strategy: patched_forward` (or auto) for a DeepseekV2-family target, "
            "or `extract.pipeline_parallel_size: 1`.",
        )
    if strategy is Strategy.EXTRACT_HIDDEN_STATES:
        passed += check_extract_hidden_states(found, device, is_mla)
        # vLLM hands eagle_aux_hidden_state_layer_ids to the model's set_aux_hidden_state_layers:
        # the aux interface's limits (id 0, id L) hold here too.
        return passed + check_plan(Strategy.AUX_LAYERS, found, layer_ids, num_layers, spec)
    if strategy is Strategy.AUX_LAYERS:
        if not found["has_aux_interface"]:
            raise _fail(
                found["model_class"],
                "set_aux_hidden_state_layers and an inner forward returning aux states",
                "neither",
                "Set `capture.strategy: patched_forward` (or auto).",
            )
        passed.append("model has set_aux_hidden_state_layers and returns (hidden, [aux...])")
        if 0 in layer_ids and not spec.aux_captures_embeddings:
            raise _fail(
                found["inner_class"],
                "aux capture of id 0",
                "aux states summed with a residual that is None before layer 0",
                "Drop id 0 from `capture.layer_ids` or set `capture.strategy: patched_forward`.",
            )
        if num_layers in layer_ids:
            if not found["aux_captures_final"]:
                raise _fail(
                    found["inner_class"],
                    f"aux capture of id {num_layers} (final pre-norm state)",
                    "no capture after the last layer",
                    "Set `capture.strategy: patched_forward`.",
                )
            passed.append(f"inner forward captures id {num_layers} (final pre-norm state)")
    else:  # Strategy.PATCHED_FORWARD
        if spec.inner_cls != "DeepseekV2Model":
            raise _fail(
                found["inner_class"],
                "a DeepseekV2-family model (eagleflow's patched forward replicates "
                "DeepseekV2Model.forward)",
                spec.inner_cls,
                "Use `capture.strategy: aux_layers` (or auto).",
            )
        if found["embedding_method"] is None:
            raise _fail(
                found["inner_class"],
                "embed_input_ids or get_input_embeddings",
                "neither",
                "Install a supported vLLM version.",
            )
        passed.append(f"embedding method {found['embedding_method']} exists")
        expected = list(spec.layer_params)
        got = found["layer_call_signature"]
        if got[: len(expected)] != expected or any(
            p for p in got[len(expected) :] if p not in ("kwargs",)
        ):
            raise _fail(
                found["layer_class"] + ".forward",
                f"({', '.join(expected)})",
                f"({', '.join(got)})",
                "eagleflow's patched forward would call the layer wrongly; upgrade eagleflow or "
                "use `capture.strategy: aux_layers`.",
            )
        passed.append(f"decoder layer forward is ({', '.join(got)})")
    return passed


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the decoder layers [start_layer, end_layer) the installed vLLM gives
    it, and the layer ids it captures (module docstring)."""

    rank: int
    start_layer: int
    end_layer: int
    layer_ids: tuple[int, ...]


def pipeline_stages(num_layers: int, layer_ids: list[int], pp: int) -> tuple[Stage, ...]:
    """The stages of a `pp`-stage pipeline as the installed vLLM partitions the layers (read
    from `get_pp_indices`, not recomputed), each with the ids it owns."""
    from vllm.distributed.utils import get_pp_indices

    if pp > num_layers:
        raise CaptureCheckError(
            f"extract.pipeline_parallel_size is {pp} but the target has {num_layers} decoder "
            f"layers; each pipeline stage needs at least one, so use at most {num_layers} stages"
        )
    try:
        bounds = [get_pp_indices(num_layers, rank, pp) for rank in range(pp)]
    except ValueError as e:  # a VLLM_PP_LAYER_PARTITION that does not fit
        raise CaptureCheckError(
            f"vLLM {vllm_version()} refuses the pipeline partition of {num_layers} layers into "
            f"{pp} stages ({e}); fix or unset VLLM_PP_LAYER_PARTITION"
        ) from None
    stages = []
    for rank, (start, end) in enumerate(bounds):
        if end <= start:
            raise CaptureCheckError(
                f"pipeline stage {rank} of {pp} gets no decoder layer (layers {start}..{end}); "
                "fix VLLM_PP_LAYER_PARTITION or use fewer stages"
            )
        last = rank == pp - 1
        owned = tuple(k for k in layer_ids if start <= k < end or (last and k == end))
        stages.append(Stage(rank, start, end, owned))
    return tuple(stages)


@dataclass(frozen=True)
class CapturePlan:
    """What the `patch` rule decided and checked, read by every job that touches the engine.
    Written as `capture_plan.json` (`save`); `introspection` is what the installed vLLM was
    found to offer (classes, signatures, interfaces), kept for the record. `storage_dtype`
    tells the workers how to store the states (`eagleflow.store.quant`); a plan written before
    it existed reads as the default."""

    strategy: Strategy
    requested_strategy: str
    layer_ids: list[int]
    num_hidden_layers: int
    hidden_size: int
    architecture: str
    wrapper: str | None
    llama_4_scaling: dict | None
    vllm_version: str
    device: str
    checks_passed: list[str]
    introspection: dict = field(default_factory=dict)
    fingerprint: str | None = None
    pipeline_parallel_size: int = 1
    # Which stage runs which layers and captures which ids (`pipeline_stages`).
    stages: tuple[Stage, ...] = ()
    layer_id_convention: str = CONVENTION
    layer_id_convention_text: str = CONVENTION_TEXT
    storage_dtype: str = DEFAULT_STORAGE

    @property
    def embedding_method(self) -> str | None:
        return self.introspection.get("embedding_method")

    def to_json(self) -> dict:
        """Plain JSON types (also what `collective_rpc` hands the workers)."""
        return asdict(self) | {"strategy": self.strategy.value}

    @classmethod
    def from_json(cls, record: dict) -> CapturePlan:
        stages = tuple(
            Stage(s["rank"], s["start_layer"], s["end_layer"], tuple(s["layer_ids"]))
            for s in record.get("stages", ())
        )
        return cls(**(record | {"strategy": Strategy(record["strategy"]), "stages": stages}))

    @property
    def capturing_stages(self) -> tuple[Stage, ...]:
        """The stages that own at least one layer id (each writes its own columns and markers)."""
        return tuple(s for s in self.stages if s.layer_ids)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path) -> CapturePlan:
        with open(path) as f:
            return cls.from_json(json.load(f))


def make_plan(
    info: TargetInfo,
    layer_ids: list[int],
    requested: str,
    device: str = "cpu",
    pipeline_parallel_size: int = 1,
    storage_dtype: str = DEFAULT_STORAGE,
) -> CapturePlan:
    try:
        check_storage_dtype(storage_dtype)
    except ValueError as e:
        raise CaptureCheckError(str(e)) from None
    spec = ARCHITECTURES.get(info.architecture)
    if spec is None:
        raise CaptureCheckError(
            f"{info.path}/config.json: architecture {info.architecture} has no capture adapter in "
            f"eagleflow (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    found = introspect(spec)
    if info.wrapper is not None:
        found |= introspect_wrapper(info.wrapper)
    pp = pipeline_parallel_size
    stages = pipeline_stages(info.num_layers, layer_ids, pp)
    strategy = choose_strategy(requested, found, layer_ids, info.num_layers, spec, pp)
    if strategy is Strategy.EXTRACT_HIDDEN_STATES:
        found |= introspect_extract_hidden_states()
    checks = check_plan(
        strategy,
        found,
        layer_ids,
        info.num_layers,
        spec,
        device=device,
        is_mla=info.is_mla,
        pipeline_parallel_size=pp,
    )
    if pp > 1:
        checks += [
            f"pipeline stage {s.rank}: layers {s.start_layer}..{s.end_layer - 1}, "
            f"captures ids {list(s.layer_ids)}"
            for s in stages
        ]
    checks += [f"wrapper {info.wrapper}: {c}" for c in found.get("wrapper_checks", [])]
    return CapturePlan(
        strategy=strategy,
        requested_strategy=requested,
        layer_ids=list(layer_ids),
        num_hidden_layers=info.num_layers,
        hidden_size=info.hidden_size,
        architecture=info.architecture,
        wrapper=info.wrapper,
        llama_4_scaling=info.text_config.get("llama_4_scaling"),
        vllm_version=vllm_version(),
        device=device,
        checks_passed=checks,
        introspection=found,
        pipeline_parallel_size=pp,
        stages=stages,
        storage_dtype=storage_dtype,
    )


def plan_for_pipeline(plan: CapturePlan, info: TargetInfo, pp: int) -> CapturePlan:
    """`plan` for a `pp`-stage pipeline: itself if it was made for `pp` stages, else the plan
    `make_plan` makes for `pp` from the same request (the stored plan is not rewritten when
    only the parallelism changes: the fingerprint, and so the shards, do not depend on it)."""
    if plan.pipeline_parallel_size == pp and plan.stages:
        return plan
    fresh = make_plan(
        info,
        plan.layer_ids,
        plan.requested_strategy,
        plan.device,
        pp,
        storage_dtype=plan.storage_dtype,
    )
    return replace(fresh, fingerprint=plan.fingerprint)
