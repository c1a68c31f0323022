"""The engine <-> server protocol (paged.engine.messages): every message round-trips through
msgpack unchanged, with its types."""

from __future__ import annotations

import msgspec
import pytest

from paged.engine import messages as m
from paged.engine.core import EngineOutput as ReExported
from paged.sampling.params import SamplingParams


def _both_ways(msg, decoder):
    return decoder.decode(m.encoder().encode(msg))


def test_engine_output_is_reexported_by_the_core():
    assert ReExported is m.EngineOutput
    eo = ReExported("r", [7], False)  # positional, as the core and tests build it
    assert (eo.finish_reason, eo.error, eo.logprobs) == (None, None, None)


def test_add_round_trips_sampling_params():
    p = SamplingParams(
        n=1,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=2**63 + 5,  # seed + i of an n > 1 request may pass int64
        max_tokens=None,
        stop="END",
        stop_token_ids=[3, 4],
        logit_bias={5: -1.5, 70000: 2},
        logprobs=0,
        eos_token_ids=(2, 9),
    )
    q = SamplingParams(seed=-(2**63), stop=["a", "bc"], ignore_eos=True, min_tokens=2)
    msg = m.Add([m.NewRequest("a", [1, 2, 3], p), m.NewRequest("b-1", [4], q)])
    back = _both_ways(msg, m.to_engine_decoder())
    assert type(back) is m.Add and back == msg
    got = back.requests[0].params
    assert type(got) is SamplingParams and got == p
    assert got.eos_token_ids == (2, 9) and type(got.eos_token_ids) is tuple
    assert got.logit_bias == {5: -1.5, 70000: 2.0} and all(type(k) is int for k in got.logit_bias)
    assert got.stop == ["END"] and got.stop_token_ids == [3, 4] and got.max_tokens is None
    assert back.requests[1].params.stop == ["a", "bc"]


def test_abort_and_shutdown_round_trip():
    dec = m.to_engine_decoder()
    assert _both_ways(m.Abort(["x", "y-0"]), dec) == m.Abort(["x", "y-0"])
    assert type(_both_ways(m.Shutdown(), dec)) is m.Shutdown


def test_from_engine_messages_round_trip():
    dec = m.from_engine_decoder()
    info = m.EngineInfo(2048, 49152, "SmolLM2", 1000, 16, 1234, "cpu", "float32")
    assert _both_ways(m.Ready(info), dec) == m.Ready(info)
    assert msgspec.structs.asdict(info)["max_model_len"] == 2048
    assert _both_ways(m.Error("ValueError: no"), dec) == m.Error("ValueError: no")
    assert type(_both_ways(m.Alive(), dec)) is m.Alive
    outs = [
        m.EngineOutput("a", [5, 6], False, num_prompt_tokens=3, num_cached_tokens=2),
        m.EngineOutput("b", [7], True, "stop", "END", 4, 0, None, [{7: -0.5, 8: -1.25}]),
        m.EngineOutput("c", [9], True, "stop", 9),  # a stop token id
        m.EngineOutput("d", [], True, "rejected", error="prompt: too long"),
    ]
    stats = {"num_requests_running": 2, "kv_cache_usage_perc": 0.25}
    back = _both_ways(m.Outputs(outs, stats, {"a": 0.01}), dec)
    assert back == m.Outputs(outs, stats, {"a": 0.01})
    assert back.outputs[1].logprobs == [{7: -0.5, 8: -1.25}]
    assert back.outputs[1].stop_reason == "END" and back.outputs[2].stop_reason == 9


def test_each_direction_only_decodes_its_own_messages():
    with pytest.raises(msgspec.ValidationError):
        m.to_engine_decoder().decode(m.encoder().encode(m.Alive()))
    with pytest.raises(msgspec.ValidationError):
        m.from_engine_decoder().decode(m.encoder().encode(m.Shutdown()))


def test_invalid_params_do_not_decode():
    """SamplingParams validates on decode as on construction."""
    bad = m.encoder().encode(m.Add([m.NewRequest("a", [1], SamplingParams())]))
    raw = msgspec.msgpack.decode(bad)
    raw[1][0][2]["temperature"] = -1.0
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        m.to_engine_decoder().decode(msgspec.msgpack.encode(raw))
