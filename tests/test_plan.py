import json

import pytest

from harmony_opt import PlanError
from harmony_opt.core.plan import Plan


def good(**kw):
    d = dict(planner="t", mode="vPP", gpus=2, batch=8, microbatch_fwd=2, microbatch_bwd=2,
             packs_fwd=[(0, 1)], packs_bwd=[(0, 1), (2, 3)], num_layers=4)
    d.update(kw)
    return Plan(**d)


def test_json_roundtrip(tmp_path):
    p = good()
    q = Plan.load(p.save(tmp_path / "p.json"))
    assert q == p
    h = good(gpu_handoff=True)
    assert Plan.load(h.save(tmp_path / "h.json")) == h != p
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["microbatch"] == {"fwd": 2, "bwd": 2} and d["packs"]["bwd"] == [[0, 1], [2, 3]]
    assert "transfer_order" not in d            # Harmony's rule: the file reads as before the field existed
    o = good(transfer_order=[(1, "swap_out", ["Y[2]@2+2", "Y[2]@0+2"])])
    assert Plan.load(o.save(tmp_path / "o.json")) == o != p
    assert json.loads((tmp_path / "o.json").read_text())["transfer_order"] == [
        {"rank": 1, "stream": "swap_out", "order": ["Y[2]@2+2", "Y[2]@0+2"]}]


@pytest.mark.parametrize("kw,fragment", [
    ({"packs_bwd": [(0, 2), (2, 3)]}, "overlaps"),
    ({"packs_bwd": [(0, 1), (3, 3)]}, "leaves layers 2..2 uncovered"),
    ({"packs_fwd": [(0, 0)]}, "must end at layer 1"),
    ({"microbatch_fwd": 3}, "does not divide"),
    ({"mode": "vXP"}, "mode"),
    ({"gpus": 0}, "gpus"),
    ({"packs_fwd": [], "packs_bwd": [(0, 3)], "microbatch_bwd": 16}, "larger than"),
    ({"transfer_order": [(2, "swap_out", ())]}, r"transfer_order\[0\]: rank 2 is not one of the plan's 2 GPUs"),
    ({"transfer_order": [(0, "compute", ())]}, "stream 'compute' is not one of swap_in, swap_out, free"),
    ({"transfer_order": [(0, "swap_in", ()), (0, "swap_in", ())]}, r"transfer_order\[1\]: .* ordered twice"),
    ({"transfer_order": [(0, "swap_in", ("X[0]@0+2", "X[0]@0+2"))]}, "X\\[0\\]@0\\+2 is named twice"),
])
def test_bad_plans_name_the_field(kw, fragment):
    with pytest.raises(PlanError, match=fragment):
        good(**kw)


def test_malformed_json_names_the_field(tmp_path):
    d = good().to_dict()
    d["packs"]["fwd"] = [[0]]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"packs.fwd\[0\]"):
        Plan.load(f)
    d = good().to_dict()
    d["transfer_order"] = [{"rank": 0, "stream": "swap_out", "order": "Y[2]@0+2"}]
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"transfer_order\[0\] must be an object with rank"):
        Plan.load(f)
    f.write_text('{"planner": "x"')
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(f)


def test_uneven_microbatches_when_declared():
    p = good(microbatch_fwd=3, allow_uneven=True)
    assert p.microbatches("FWD") == [3, 3, 2]


def test_gpu_handoff_applies_to_one_microbatch_on_each_side():
    p = good(gpu_handoff=True)
    assert p.keeps_on_gpu([4], [4])
    assert not p.keeps_on_gpu([2, 2], [2, 2])      # the producer's whole group would stay resident
    assert not p.keeps_on_gpu([4], [2, 2])          # re-batched: through host memory, where rows are cheap
    assert not good().keeps_on_gpu([4], [4])        # off by default (Harmony's rule)
    d = good().to_dict()
    d["gpu_handoff"] = "yes"
    with pytest.raises(PlanError, match="gpu_handoff must be true or false"):
        Plan.from_dict(d)
