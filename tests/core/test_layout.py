from __future__ import annotations

import pytest
import torch

from ciuic_p2p.core.codec.layout import BucketLayout


def mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def test_small_tensors_go_to_a_dense_bucket() -> None:
    layout = BucketLayout.for_module(mlp(), dense_below_numel=1000)
    kinds = {s.name: layout.buckets[s.bucket].sparse for s in layout.slots}
    assert kinds == {"0.weight": True, "0.bias": False, "2.weight": True, "2.bias": False}
    assert sum(b.numel for b in layout.buckets) == sum(p.numel() for p in mlp().parameters())


def test_views_share_memory_with_the_buckets() -> None:
    model = mlp()
    layout = BucketLayout.for_module(model)
    buckets = layout.new_buckets()
    layout.flatten_into(dict(model.named_parameters()), buckets)
    views = layout.views(buckets)
    for name, p in model.named_parameters():
        assert torch.equal(views[name], p.detach())
    views["0.bias"].add_(1.0)
    slot = next(s for s in layout.slots if s.name == "0.bias")
    bias = dict(model.named_parameters())["0.bias"].detach()
    assert float(buckets[slot.bucket][slot.offset]) == float(bias[0]) + 1.0


def test_layout_id_tells_models_apart_and_is_stable() -> None:
    a = BucketLayout.build([("w", (10, 20)), ("b", (20,))])
    assert a.layout_id == BucketLayout.build([("w", (10, 20)), ("b", (20,))]).layout_id
    assert a.layout_id != BucketLayout.build([("w", (20, 10)), ("b", (20,))]).layout_id
    assert a.layout_id != BucketLayout.build([("b", (20,)), ("w", (10, 20))]).layout_id


def test_buckets_are_capped() -> None:
    layout = BucketLayout.build([(f"w{i}", (1000,)) for i in range(5)], 10, max_bucket_numel=2500)
    assert [b.numel for b in layout.buckets] == [2000, 2000, 1000]
    with pytest.raises(ValueError, match="more than a bucket"):
        BucketLayout.build([("big", (3000,))], 10, max_bucket_numel=2500)
    with pytest.raises(ValueError, match="duplicate"):
        BucketLayout.build([("a", (1,)), ("a", (1,))])
