"""Start-up refusals of a tensor / pipeline split (model/parallel.py's check_split): what the
model's config.json rules out is refused before any rank starts, by exactly the rule every
rank would apply (head_shard, split_range), and everything it lets through builds."""

from types import SimpleNamespace

import pytest

from paged.config import EngineConfig
from paged.model.parallel import check_split, head_shard, split_range


def hf(heads: int = 9, kv: int = 3, layers: int = 30) -> SimpleNamespace:
    """The default model's shape (SmolLM2-135M) unless told otherwise."""
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                           num_hidden_layers=layers)  # fmt: skip


@pytest.mark.parametrize(("heads", "kv"), [(9, 3), (4, 2), (4, 1), (8, 8), (32, 8), (12, 4)])
def test_check_split_refuses_exactly_what_head_shard_cannot_place(heads, kv):
    for tp in range(1, 2 * heads + 2):
        try:
            shards = [head_shard(heads, kv, tp, r) for r in range(tp)]
        except ValueError:
            with pytest.raises(ValueError, match=f"^tensor_parallel_size: {tp} ranks"):
                check_split(hf(heads, kv), tp, 1)
            continue
        check_split(hf(heads, kv), tp, 1)  # accepted: every rank's shard is whole and used
        assert all(s.q_count > 0 and s.kv_count > 0 for s in shards), (heads, kv, tp)
        covered = sorted(q for s in shards for q in range(s.q_start, s.q_start + s.q_count))
        assert covered == list(range(heads)), (heads, kv, tp)


def test_the_default_models_sizes():
    for tp in (1, 2, 3, 9):
        check_split(hf(), tp, 1)
    for tp in (4, 5, 6, 18):
        with pytest.raises(ValueError, match="at most 3 ranks, or a multiple of 3 that divides"):
            check_split(hf(), tp, 1)
    check_split(hf(), 1, 30)
    with pytest.raises(ValueError, match="^pipeline_parallel_size: 31 stages for the model's 30"):
        check_split(hf(), 1, 31)
    assert all(split_range(30, 30, r)[1] > split_range(30, 30, r)[0] for r in range(30))


def test_heads_that_do_not_share_kv_heads_and_partial_configs():
    with pytest.raises(ValueError, match="^model: 9 attention heads do not share 2 KV heads"):
        check_split(hf(9, 2), 1, 1)
    check_split(SimpleNamespace(num_attention_heads=4), 4, 1)  # no KV heads key: as many
    check_split(SimpleNamespace(), 7, 5)  # nothing to check against: the engine decides


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                   {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}])
def test_async_scheduling_with_several_ranks_is_refused_in_the_config(sizes):
    with pytest.raises(ValueError, match="^async_scheduling: not supported with more than one"):
        EngineConfig(async_scheduling=True, **sizes)
    assert EngineConfig(async_scheduling=False, **sizes).async_scheduling is False
    assert EngineConfig(**sizes).async_scheduling is None  # the default: turned off, not refused
    with pytest.raises(ValueError, match="^runner: pooling"):
        EngineConfig(runner="pooling", pipeline_parallel_size=2)


def test_resolve_config_refuses_before_any_rank_starts():
    """Offline (LLM) and run-batch paths: resolve_config, in the engine process, refuses the
    split before the executor starts a rank."""
    from transformers import LlamaConfig

    from paged.worker.worker import resolve_config
    from paged_cpu.platform import CpuPlatform

    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], num_attention_heads=9,
                      num_key_value_heads=3, hidden_size=576, num_hidden_layers=30)  # fmt: skip
    with pytest.raises(ValueError, match="^tensor_parallel_size: 4 ranks"):
        resolve_config(EngineConfig(tensor_parallel_size=4), CpuPlatform(), cfg)
    with pytest.raises(ValueError, match="^pipeline_parallel_size: 31 stages"):
        resolve_config(EngineConfig(pipeline_parallel_size=31), CpuPlatform(), cfg)
    two = resolve_config(EngineConfig(tensor_parallel_size=2), CpuPlatform(), cfg)
    assert two.async_scheduling is False


def test_check_model_refuses_a_moe_routing_more_experts_than_it_has():
    from paged.server.serving_stack import _check_experts

    _check_experts(SimpleNamespace(num_local_experts=8, num_experts_per_tok=2))
    _check_experts(SimpleNamespace(num_experts=0, num_experts_per_tok=2))  # dense: none
    with pytest.raises(ValueError, match="^model: num_experts_per_tok 9 exceeds the 8 experts"):
        _check_experts(SimpleNamespace(num_experts=8, num_experts_per_tok=9))
