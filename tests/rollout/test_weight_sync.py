"""Weight sync: size-bounded buckets, one load per bucket, one prefix-cache reset per sync."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.hf import HFEngine
from lightning_grpo.rollout.weight_sync import iter_buckets, layer_group_key, named_weights, push_weights

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


class RecordingEngine:
    """Records what a sync hands over (the vLLM path is checked end to end in test_rollout_vllm.py)."""

    dtype = torch.bfloat16

    def __init__(self) -> None:
        self.events: list[tuple[str, list[tuple[str, torch.Tensor]] | None]] = []

    def load_weights(self, named_tensors):
        self.events.append(("load", list(named_tensors)))

    def reset_prefix_cache(self):
        self.events.append(("reset", None))


def nbytes(bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


@pytest.fixture
def policy(tiny_policy_dir):
    return load_policy(PolicyConfig(path=str(tiny_policy_dir)))


def test_buckets_stay_within_the_bound_and_a_big_tensor_goes_alone():
    sizes = [10, 300, 40, 40, 2000, 5, 5, 700, 1]  # float32 elements
    named = [(f"t{i}", torch.randn(n)) for i, n in enumerate(sizes)]
    buckets = list(iter_buckets(named, bucket_bytes=1600, group_key=None))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order kept, nothing lost
    for b in buckets:
        assert nbytes(b) <= 1600 or len(b) == 1
    assert [len(b) for b in buckets] == [4, 1, 2, 1, 1]  # 2000 and 700 floats exceed the bucket: alone


def test_buckets_cast_detach_and_count_bytes_after_the_cast():
    w = torch.nn.Parameter(torch.randn(64, 8))
    [[(_, t)]] = list(iter_buckets([("w", w)], bucket_bytes=1 << 20, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and not t.requires_grad and t.is_contiguous()
    buckets = list(iter_buckets([("w", w)] * 4, bucket_bytes=2 * w.numel() * 2, dtype=torch.bfloat16, group_key=None))
    assert [len(b) for b in buckets] == [2, 2]  # sized in bfloat16 bytes: two a bucket, where float32 fits one


@pytest.mark.parametrize(
    "name, key",
    [
        ("model.layers.3.self_attn.q_proj.weight", "model.layers.3"),
        ("model.layers.3.mlp.experts.7.up_proj.weight", "model.layers.3"),
        ("model.embed_tokens.weight", "model"),
        ("lm_head.weight", "lm_head"),
    ],
)
def test_layer_group_key(name, key):
    assert layer_group_key(name) == key


def test_a_decoder_layer_is_never_split_across_buckets(policy):
    model, _ = policy
    buckets = list(iter_buckets(named_weights(model), bucket_bytes=1))  # every group overflows: one group a bucket
    keys = [{layer_group_key(n) for n, _ in b} for b in buckets]
    assert all(len(k) == 1 for k in keys)
    layers = [k for ks in keys for k in ks if k.startswith("model.layers.")]
    assert layers == ["model.layers.0", "model.layers.1"]  # each layer whole, in one bucket
    assert any(len(b) > 1 for b in buckets)


def test_push_calls_load_once_per_bucket_then_resets_once(policy):
    model, _ = policy
    engine = RecordingEngine()
    stats = push_weights(model, engine, bucket_bytes=40_000)
    loads = [b for kind, b in engine.events if kind == "load"]
    assert [kind for kind, _ in engine.events] == ["load"] * len(loads) + ["reset"]
    names = [n for n, _ in model.named_parameters()]
    assert stats.n_buckets == len(loads) > 1 and stats.n_tensors == len(names)
    assert [n for b in loads for n, _ in b] == names  # tied lm_head sent once, as embed_tokens
    assert all(t.dtype == torch.bfloat16 for b in loads for _, t in b)  # the engine's dtype
    assert stats.bytes == sum(nbytes(b) for b in loads) == sum(p.numel() * 2 for p in model.parameters())


def test_push_into_an_engine_on_another_copy_makes_it_equal(tiny_policy_dir):
    trainer, _ = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    served, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p))
    push_weights(trainer, HFEngine(served, tok), bucket_bytes=20_000)
    for (n, a), (_, b) in zip(trainer.state_dict().items(), served.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo group (reusing one that is already up)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def test_dtensor_parameters_are_gathered_to_full_tensors(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(8, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    [[(_, t)]] = list(iter_buckets([("w", sharded)], bucket_bytes=1 << 20))
    assert type(t) is torch.Tensor and torch.equal(t, full)
