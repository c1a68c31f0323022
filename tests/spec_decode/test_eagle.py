"""EAGLE heads on a tiny random Llama: a head checkpoint written in the EAGLE-1 layout (fc over
the embedding and the target's hidden state, one decoder layer without its input norm, the
target's embedding and LM head). Greedy output token-identical to plain decoding (batched,
chunked prefill, prefix-cache hits, preemption, overlapped steps); the head's proposals equal
a torch reference of the EAGLE forward on HF's target; a head that agrees with its target has
every proposal accepted; sampling and n > 1 run; refusals name the key."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from paged import LLM, SamplingParams
from paged.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
K = 3
H, INTER, KV = 64, 128, 32  # tests/conftest.py TINY: 4 heads of 16, 2 KV heads


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    rnd = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 9, 70)]
    base = torch.randint(2, 320, (8,), generator=g).tolist()
    return [*rnd, base * 5]  # 70 tokens: three chunks of 32


def write_head(
    path: str, target: str, seed: int, fc_bias: bool = False, agree: bool = False
) -> str:
    """An EAGLE-1 checkpoint for `target`: config.json (the target's, one layer) and
    model.safetensors, random weights. `agree`: fc passes the embedding through and the layer
    adds nothing (o_proj, down_proj zero)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(target, num_hidden_layers=1)
    cfg.architectures = ["EagleLlamaForCausalLM"]
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (H, H),
        "layers.0.self_attn.k_proj.weight": (KV, H),
        "layers.0.self_attn.v_proj.weight": (KV, H),
        "layers.0.self_attn.o_proj.weight": (H, H),
        "layers.0.mlp.gate_proj.weight": (INTER, H),
        "layers.0.mlp.up_proj.weight": (INTER, H),
        "layers.0.mlp.down_proj.weight": (H, INTER),
    }
    w = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    w["layers.0.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    if fc_bias:
        w["fc.bias"] = 0.1 * torch.randn(H, generator=g)
    if agree:
        w["fc.weight"] = torch.cat((torch.eye(H), torch.zeros(H, H)), 1)
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def head(tiny, tmp_path_factory) -> str:
    return write_head(str(tmp_path_factory.mktemp("eagle")), tiny, seed=3, fc_bias=True)


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    plain = LLM(tiny, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32)
    return [o.outputs[0].token_ids for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]


def eagle_llm(target: str, head: str, **kw) -> LLM:
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    kw = {"num_kv_blocks": 96, "max_num_batched_tokens": 32, **kw}
    return LLM(target, dtype="float32", speculative_config=spec, **kw)


def generate(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    llm.engine.kv.check_invariants(list(llm.engine.requests.values()))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks, "blocks leaked"
    return out


def spec_stats(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.engine.metrics().items() if k.startswith("spec_decode")}


@pytest.fixture(scope="module")
def eagle(tiny, head) -> LLM:
    return eagle_llm(tiny, head)


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its proposals) of every verification from now on."""
    seen, spec = [], llm.engine.spec
    propose = spec.propose

    def wrapped(batch):
        propose(batch)
        for r in batch.reqs:
            if r.request_id in batch.spec:
                seen.append((list(r.token_ids), list(batch.spec[r.request_id])))

    spec.propose = wrapped
    return seen


def test_greedy_identical_with_prefix_cache(eagle, reference):
    assert generate(eagle, prompts()) == reference
    s = spec_stats(eagle)
    assert s["spec_decode_num_drafts"] > 0
    assert s["spec_decode_num_draft_tokens"] >= s["spec_decode_num_drafts"]
    per_pos = [s[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(K)]
    assert sum(per_pos) == s["spec_decode_num_accepted_tokens"]
    # Again: prefix-cache hits (the head skips the positions the target does not compute).
    assert generate(eagle, prompts()) == reference
    assert eagle.engine.kv.hits > 0
    assert spec_stats(eagle)["spec_decode_num_drafts"] > s["spec_decode_num_drafts"]
    kept = eagle.engine.spec.draft.rows.keys()  # rows of finished requests are forgotten
    assert not kept - set(eagle.engine.scheduler.finished_ids)


class _Reference(nn.Module):
    """The EAGLE-1 forward in plain torch and HF transformers, without a KV cache."""

    def __init__(self, target_path: str, head_path: str) -> None:
        super().__init__()
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaModel

        self.target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
        w = load_file(os.path.join(head_path, "model.safetensors"))
        cfg = LlamaConfig.from_pretrained(head_path)
        self.layer = LlamaModel(cfg).float().eval()  # one decoder layer
        self.layer.layers[0].input_layernorm = nn.Identity()  # EAGLE skips it
        self.layer.norm = nn.Identity()  # the output is the layer's sum with its residual
        missing = self.layer.load_state_dict(w, strict=False).missing_keys
        assert missing == ["embed_tokens.weight"]
        self.fc_w, self.fc_b = w["fc.weight"], w.get("fc.bias", torch.zeros(H))

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """k greedy proposals after `tokens`: position p takes token p + 1 with the target's
        hidden state at p, past the target's the head's own output at p - 1."""
        ids = torch.tensor(tokens)
        target_hidden = self.target.model(ids[None]).last_hidden_state[0]  # after its norm
        embed = self.target.model.embed_tokens
        embeds, hidden, out = embed(ids[1:]), target_hidden[:-1], []
        for _ in range(k):
            x = torch.cat((embeds, hidden), -1) @ self.fc_w.T + self.fc_b
            last = self.layer(inputs_embeds=x[None]).last_hidden_state[0, -1]
            out.append(int(self.target.lm_head(last).argmax()))
            embeds = torch.cat((embeds, embed(torch.tensor(out[-1:]))))
            hidden = torch.cat((hidden, last[None]))
        return out


def test_proposals_match_a_reference_forward(tiny, head):
    llm = eagle_llm(tiny, head, enable_prefix_caching=False)
    seen = record_proposals(llm)
    generate(llm, prompts())
    assert len(seen) > 20
    ref = _Reference(tiny, head)
    for tokens, props in seen:
        assert props == ref.propose(tokens, len(props))


@pytest.fixture(scope="module")
def echo_target(tiny, tmp_path_factory) -> str:
    """The tiny model with attention and MLP outputs zeroed: its next token depends on the
    current token alone (argmax of lm_head(embed(t)))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    path = str(tmp_path_factory.mktemp("echo") / "llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_a_head_that_agrees_has_every_proposal_accepted(echo_target, tmp_path):
    plain = LLM(echo_target, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32)
    want = generate(plain, prompts())
    llm = eagle_llm(echo_target, write_head(str(tmp_path), echo_target, seed=4, agree=True))
    assert generate(llm, prompts()) == want
    s = spec_stats(llm)
    assert s["spec_decode_num_draft_tokens"] > 0
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    # Sampling requests verify the head's own distribution (q): proposals mostly accepted.
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=16, ignore_eos=True)
    generate(llm, prompts()[:2], params)
    t = spec_stats(llm)
    proposed = t["spec_decode_num_draft_tokens"] - s["spec_decode_num_draft_tokens"]
    accepted = t["spec_decode_num_accepted_tokens"] - s["spec_decode_num_accepted_tokens"]
    assert proposed > 0 and accepted > 0


def test_preemption(tiny, head, reference):
    llm = eagle_llm(tiny, head, num_kv_blocks=9, max_model_len=100)
    assert generate(llm, prompts()) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert spec_stats(llm)["spec_decode_num_drafts"] > 0


def test_overlapped_steps(tiny, head, reference):
    """--async-scheduling: steps where no request may speculate overlap (a request under
    min_tokens), the head reads only rows whose next token is on the host."""
    plain = LLM(tiny, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32)
    long = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    params = [GREEDY, GREEDY, long, GREEDY]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts(), params, use_tqdm=False)]
    llm = eagle_llm(tiny, head, async_scheduling=True)
    eng, overlapped = llm.engine, []
    can = eng._can_overlap
    eng._can_overlap = lambda: overlapped.append(can()) or overlapped[-1]
    assert generate(llm, prompts(), params) == want
    assert True in overlapped and False in overlapped
    assert spec_stats(llm)["spec_decode_num_drafts"] > 0


def test_seeded_sampling_and_several_sequences_equal_plain_decoding(tiny, eagle):
    """Seeded draws are keyed by position: proposals and verification draw what plain
    decoding draws, so the output is plain decoding's, cold or warm prefix cache."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=12,
                            ignore_eos=True, n=2)  # fmt: skip

    def run(llm: LLM) -> list[list[list[int]]]:
        outs = llm.generate(prompts()[1:3], params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]

    plain = LLM(tiny, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32)
    want = run(plain)
    assert all(len(t) == 12 and all(0 <= x < 320 for x in t) for seqs in want for t in seqs)
    assert run(eagle) == want
    assert run(eagle) == want
    assert eagle.engine.kv.num_free_blocks == eagle.engine.num_blocks


EAGLE = {"method": "eagle", "model": "x", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
        ({**EAGLE, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({**EAGLE, "top_k": 2}, "top_k"),
        ({**EAGLE, "method": "medusa"}, "method"),
        ({**EAGLE, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**EAGLE, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        ({**EAGLE, "quantization": "fp8"}, "quantization"),
    ],
)
def test_refusals_name_the_key(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value)


def test_refused_with_tensor_parallel():
    with pytest.raises(ValueError, match="EAGLE head needs tensor_parallel_size"):
        EngineConfig(speculative_config=EAGLE, tensor_parallel_size=2)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 512}, "speculative_config.model: the EAGLE head's vocab_size"),
        ({"architectures": ["LlamaForCausalLMEagle3"]}, "speculative_config.model: .* EAGLE-3"),
    ],
)
def test_a_head_that_does_not_fit_is_refused(tiny, tmp_path, change, message):
    path = write_head(str(tmp_path), tiny, seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        eagle_llm(tiny, path)
