"""The scheduler with LoRA slots: the running requests never use more adapters than
--max-loras (so no step needs more slots), base-model requests never wait for a slot, and a
request waiting for a slot is not overtaken by later LoRA requests (no adapter starves)."""

from __future__ import annotations

from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request
from paged.engine.scheduler import Scheduler
from paged.lora import LoRARequest
from paged.sampling.params import SamplingParams

A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def step(s: Scheduler) -> list[Request]:
    """One step (every sampled token 5); the requests it ran."""
    batch = s.schedule()
    computed = s.launched(batch)
    sampling = [r for r in batch.reqs if r.num_pending]
    s.resolve(batch, computed, sampling, [5] * len(sampling))
    return list(batch.reqs)


def test_adapters_within_slots_first_come_first_served():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=1)
    reqs = {
        "a0": Request("a0", [3, 4, 5], PARAMS, lora_request=A),
        "b0": Request("b0", [7, 8], PARAMS, lora_request=B),
        "base": Request("base", [9, 9, 9], PARAMS),
        "a1": Request("a1", [3, 4, 6], PARAMS, lora_request=A),  # behind b0: waits for it
    }
    for r in reqs.values():
        s.add(r)
    ran: list[set[str]] = []
    while s.has_unfinished():
        batch = step(s)
        assert len({r.lora_int_id for r in batch} - {0}) <= 1  # one slot
        assert len({r.lora_int_id for r in s.running} - {0}) <= 1
        ran.append({r.request_id for r in batch})
    first = {rid: next(i for i, ids in enumerate(ran) if rid in ids) for rid in reqs}
    assert first["a0"] == first["base"] == 0  # the base model never waits for a slot
    assert first["b0"] > 0 and first["a1"] >= first["b0"]  # a1 does not overtake b0
    assert all(r.finished for r in reqs.values())
    kv.check_invariants()
