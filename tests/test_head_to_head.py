"""benchmarks/trainer_head_to_head.py: the conversion to speculators' offline format and the
arithmetic of its settings and report (nothing here needs speculators)."""

import importlib.util
import math
import sys

import torch

from eagleflow.store.quant import dequantize, quantize
from eagleflow.train.data import ShardLayout
from support.workflow_runner import REPO


def load_script():
    path = REPO / "benchmarks" / "trainer_head_to_head.py"
    spec = importlib.util.spec_from_file_location("trainer_head_to_head", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


h2h = load_script()
# Stored as the extraction stores them: ids [2, 8, 4, 5] (the final state, id 8, not last).
LAYOUT = ShardLayout(paths=["s"], layer_ids=[2, 8, 4, 5], final_id=8, aux_ids=[2, 4, 5])


def test_sample_puts_the_aux_layers_in_stored_order_then_the_final_state():
    n, hidden = 5, 4
    states = torch.stack([torch.full((n, hidden), float(i)) for i in (2, 8, 4, 5)], 1).bfloat16()
    ids, mask = torch.arange(n, dtype=torch.int32), torch.tensor([0, 0, 1, 1, 1], dtype=torch.uint8)
    s = h2h.speculators_sample(ids, mask, states, None, LAYOUT)
    assert s["hidden_states"].shape == (n, 4, hidden)
    assert s["hidden_states"].dtype == torch.bfloat16  # copied as stored
    assert s["hidden_states"][0, :, 0].tolist() == [2.0, 4.0, 5.0, 8.0]
    # what speculators' ArrowDataset splits off: [:, :-1] aux, [:, -1] the verifier's last state
    assert s["hidden_states"][:, :-1].flatten(1).shape == (n, 3 * hidden)
    assert s["hidden_states"][:, -1].eq(8.0).all()
    assert s["token_ids"].dtype == torch.int64 and s["token_ids"].tolist() == list(range(n))
    assert s["loss_mask"].dtype == torch.int64 and s["loss_mask"].tolist() == [0, 0, 1, 1, 1]


def test_sample_dequantizes_fp8_states_with_their_layers_scales():
    n, hidden = 3, 8
    values = torch.randn(n, 4, hidden) * torch.tensor([1.0, 30.0, 0.1, 5.0])[None, :, None]
    q, scales = quantize(values)
    s = h2h.speculators_sample(torch.arange(n), torch.ones(n), q, scales, LAYOUT)
    expected = dequantize(q, scales)[:, [0, 2, 3, 1]]
    assert s["hidden_states"].dtype == torch.float32
    assert torch.equal(s["hidden_states"], expected)


def test_train_ratio_splits_exactly_between_train_and_heldout():
    for train, heldout in [(2863, 137), (1, 1), (99, 1), (10, 990), (123457, 6543)]:
        conv = h2h.Converted("r", train, heldout, 0, [2, 4, 5], 256)
        assert int((train + heldout) * conv.train_ratio) == train


def test_cosine_cycles_end_the_schedule_at_the_minimum_ratio():
    assert h2h.cosine_cycles(0.0) == 0.5  # the usual half cosine, down to 0
    for low in (0.0, 0.1, 0.5):
        c = h2h.cosine_cycles(low)
        end = 0.5 * (1 + math.cos(math.pi * c * 2.0 * 1.0))  # HF's cosine at progress 1
        assert math.isclose(end, low, abs_tol=1e-12)


def test_paired_difference_and_its_standard_error():
    diff, se = h2h.paired_difference([3.2, 3.1, 3.4], [3.0, 3.2, 3.1])
    assert math.isclose(diff, (0.2 - 0.1 + 0.3) / 3)
    d = [0.2, -0.1, 0.3]
    sd = math.sqrt(sum((x - diff) ** 2 for x in d) / 2)
    assert math.isclose(se, sd / math.sqrt(3))
    assert h2h.paired_difference([3.0], [2.5]) == (0.5, 0.0)
