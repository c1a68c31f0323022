"""The serving loop's wait for the step in flight (EngineCore.wait_inflight_forward): with
overlapped steps the next step is scheduled once the one in flight has run its forward, so a
request that arrived meanwhile joins that next step rather than the one after it."""

from __future__ import annotations

from paged import LLM, SamplingParams
from paged.worker.model_runner import StepHandle


def test_a_request_added_after_the_wait_joins_the_next_step(tiny_models, monkeypatch):
    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
              async_scheduling=True)  # fmt: skip
    engine = llm.engine
    try:
        waited: list[StepHandle] = []
        monkeypatch.setattr(StepHandle, "wait_forward", lambda self: waited.append(self))
        engine.wait_inflight_forward()  # nothing in flight: returns at once
        assert waited == []
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request("a", [5, 6, 7, 8], params)
        engine.step()
        assert engine.inflight is not None  # overlapped: the step completes in the next call
        engine.wait_inflight_forward()
        assert waited == [engine.inflight[1]]
        engine.add_request("b", [9, 10, 11], params)
        engine.step()
        assert {r.request_id for r in engine.inflight[0].reqs} == {"a", "b"}
        while engine.has_unfinished():
            engine.step()
        engine.kv.check_invariants()
        assert engine.kv.num_free_blocks == engine.num_blocks
    finally:
        engine.shutdown()


def test_the_handle_waits_on_its_forward_event():
    events = []

    class Event:
        def synchronize(self) -> None:
            events.append("sync")

    handle = StepHandle([], None, [], None)
    handle.wait_forward()  # no event (a CPU or non-overlapped step): nothing to wait for
    handle.forward_done = Event()
    handle.wait_forward()
    assert events == ["sync"]
