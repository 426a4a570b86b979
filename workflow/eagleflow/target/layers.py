"""Layer ids: one convention (vLLM's), converted once at the edge.

eagleflow (like vLLM and the EAGLE reference code) means by id k the residual stream
entering decoder layer k, and by id L (= num_hidden_layers) the final layer's output before
the final norm. SGLang, SpecForge, TensorRT-LLM and ModelOpt mean by id k the output of
layer k: the same tensor as vLLM id k+1.
"""

from __future__ import annotations

CONVENTION = "vllm"
CONVENTION_TEXT = (
    "vllm: id k = residual stream entering decoder layer k; "
    "id num_hidden_layers = final layer output before the final norm"
)


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's EAGLE-3 defaults (2, L//2, L-3) plus the final pre-norm state L."""
    return [2, num_layers // 2, num_layers - 3, num_layers]


def resolve_layer_ids(layer_ids, convention: str, num_layers: int) -> list[int]:
    """Config ids -> eagleflow (vLLM) ids, checked against the layer count."""
    if layer_ids is None:
        ids = default_layer_ids(num_layers)
    elif convention == "vllm":
        ids = list(layer_ids)
    elif convention == "output":
        ids = [k + 1 for k in layer_ids]
    else:
        raise ValueError(
            f"capture.layer_id_convention: unknown convention {convention!r}; use vllm or output"
        )
    if not ids:
        raise ValueError("capture.layer_ids: at least one layer id is needed")
    if len(set(ids)) != len(ids):
        raise ValueError(f"capture.layer_ids: duplicate ids in {ids}; list each layer once")
    if ids != sorted(ids):
        raise ValueError(
            f"capture.layer_ids: ids {ids} are not ascending; list them in layer order"
        )
    bad = [k for k in ids if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(
            f"capture.layer_ids: {bad} (in the {convention} convention, as vLLM ids {ids}) "
            f"are outside 0..{num_layers} for a target with {num_layers} layers; "
            "use ids within that range"
        )
    return ids
