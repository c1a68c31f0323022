"""EAGLE-3 heads on a tiny random 8-layer Llama: a head checkpoint written in SafeAILab's layout
(fc over the inputs of three target layers, `midlayer.*` attending over the normed embedding
and hidden state, its own final norm and LM head over a draft vocabulary smaller than the
target's, d2t / t2d). Greedy output token-identical to plain decoding (batched, chunked prefill,
prefix-cache hits, preemption); the head's proposals equal a torch reference of the EAGLE-3
forward on HF's target; the target's aux states are HF's hidden states; sampling runs with q
zero outside the draft vocabulary; refusals name what does not fit."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from test_eagle import GREEDY, generate, prompts, record_proposals, spec_stats
from tiny_hf import TINY, make_tiny

from paged import LLM, SamplingParams
from paged.config import EngineConfig

K = 3
H, INTER, V = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
HEADS, KV_HEADS = TINY["num_attention_heads"], TINY["num_key_value_heads"]  # the target's
D = H // HEADS
LAYERS = 8  # vLLM's default aux layers: inputs of layers 2, 4, 5
DRAFT_V = 200


def save_llama(path: str) -> str:
    """The target: the tests' tiny Llama (tiny_hf.py) with 8 layers."""
    return make_tiny("llama", path, num_hidden_layers=LAYERS)


def write_head(
    path: str,
    target: str,
    seed: int,
    draft_vocab: int = DRAFT_V,
    layer_ids: list[int] | None = None,
    own_embed: bool = False,
) -> str:
    """An EAGLE-3 checkpoint for `target`: config.json (the target's, one layer, draft_vocab_size,
    the aux layer ids in `eagle_config` where given) and model.safetensors, random weights."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(target, num_hidden_layers=1)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = draft_vocab
    if layer_ids is not None:
        cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    n_aux = len(layer_ids) if layer_ids else 3
    shapes = {
        "fc.weight": (H, n_aux * H),
        "midlayer.self_attn.q_proj.weight": (H, 2 * H),
        "midlayer.self_attn.k_proj.weight": (KV_HEADS * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (KV_HEADS * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, H),
        "midlayer.mlp.gate_proj.weight": (INTER, H),
        "midlayer.mlp.up_proj.weight": (INTER, H),
        "midlayer.mlp.down_proj.weight": (H, INTER),
        "lm_head.weight": (draft_vocab, H),
    }
    w = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{norm}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    w["norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    if own_embed:
        w["embed_tokens.weight"] = torch.randn(V, H, generator=g)
    covered = torch.randperm(V, generator=g)[:draft_vocab].sort().values  # target ids
    w["d2t"] = covered - torch.arange(draft_vocab)
    w["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, covered, True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return path


def draft_ids(head: str) -> set[int]:
    """The target ids a head's draft vocabulary covers."""
    from safetensors.torch import load_file

    return set(load_file(os.path.join(head, "model.safetensors"))["t2d"].nonzero()[:, 0].tolist())


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return save_llama(str(tmp_path_factory.mktemp("eagle3") / "target"))


@pytest.fixture(scope="module")
def head(target, tmp_path_factory) -> str:
    return write_head(str(tmp_path_factory.mktemp("eagle3_head")), target, seed=3)


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:
    plain = LLM(target, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32)
    return [o.outputs[0].token_ids for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]


def eagle3_llm(target: str, head: str, **kw) -> LLM:
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K}
    kw = {"num_kv_blocks": 96, "max_num_batched_tokens": 32, **kw}
    return LLM(target, dtype="float32", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def eagle3(target, head) -> LLM:
    return eagle3_llm(target, head)


def test_greedy_identical_with_prefix_cache(eagle3, reference, head):
    seen = record_proposals(eagle3)
    assert generate(eagle3, prompts()) == reference
    s = spec_stats(eagle3)
    assert s["spec_decode_num_drafts"] > 0
    assert eagle3.engine.runner.model.aux_layers == (2, 4, 5)
    covered = draft_ids(head)
    assert seen and all(set(props) <= covered for _, props in seen)  # mapped through d2t
    # Again: prefix-cache hits (the head skips the positions the target does not compute).
    assert generate(eagle3, prompts()) == reference
    assert eagle3.engine.kv.hits > 0
    assert spec_stats(eagle3)["spec_decode_num_drafts"] > s["spec_decode_num_drafts"]


def test_preemption(target, head, reference):
    llm = eagle3_llm(target, head, num_kv_blocks=9, max_model_len=100)
    assert generate(llm, prompts()) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert spec_stats(llm)["spec_decode_num_drafts"] > 0


class _Reference:
    """The EAGLE-3 forward in plain torch on HF's target, without a KV cache."""

    def __init__(self, target_path: str, head_path: str, aux: tuple[int, ...]) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
        self.w = load_file(os.path.join(head_path, "model.safetensors"))
        self.aux = aux
        self.rope = LlamaRotaryEmbedding(LlamaConfig.from_pretrained(head_path))
        self.to_target = torch.arange(self.w["d2t"].numel()) + self.w["d2t"]
        own = self.w.get("embed_tokens.weight")
        self.embed = self.target.model.embed_tokens.weight if own is None else own

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w[name]

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The midlayer's output plus its residual (the hidden state before the final norm)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, t = self.w, embeds.shape[0]
        x = torch.cat((self.norm(embeds, "midlayer.input_layernorm.weight"),
                       self.norm(hidden, "midlayer.hidden_norm.weight")), -1)  # fmt: skip

        def proj(name: str, heads: int) -> torch.Tensor:
            return (x @ w[f"midlayer.self_attn.{name}.weight"].T).view(t, heads, D).transpose(0, 1)

        cos, sin = self.rope(x[None], torch.arange(t)[None])
        q, k = apply_rotary_pos_emb(proj("q_proj", HEADS)[None], proj("k_proj", KV_HEADS)[None],
                                    cos, sin)  # fmt: skip
        rep = HEADS // KV_HEADS
        v = proj("v_proj", KV_HEADS)[None].repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v, is_causal=True)
        h = hidden + a[0].transpose(0, 1).reshape(t, H) @ w["midlayer.self_attn.o_proj.weight"].T
        m = self.norm(h, "midlayer.post_attention_layernorm.weight")
        gate, up = (m @ w[f"midlayer.mlp.{n}.weight"].T for n in ("gate_proj", "up_proj"))
        return h + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def aux_states(self, ids: torch.Tensor) -> torch.Tensor:
        """[tokens, 3 H]: HF's hidden_states[i] is the input of layer i (i < layers)."""
        hs = self.target.model(ids[None], output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in self.aux], -1)

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """k greedy proposals after `tokens`: position p takes token p + 1 with fc of the
        target's aux states at p, past the target's the head's own output at p - 1."""
        ids = torch.tensor(tokens)
        hidden = (self.aux_states(ids) @ self.w["fc.weight"].T)[:-1]
        embeds, out = self.embed[ids[1:]], []
        for _ in range(k):
            last = self.layer(embeds, hidden)[-1]
            draft = self.norm(last, "norm.weight") @ self.w["lm_head.weight"].T
            out.append(int(self.to_target[draft.argmax()]))
            embeds = torch.cat((embeds, self.embed[out[-1:]]))
            hidden = torch.cat((hidden, last[None]))
        return out


def test_aux_states_are_the_inputs_of_the_target_layers(eagle3, target):
    """The target's forward with aux_layers returns HF's hidden_states at those layers."""
    ref = _Reference(target, eagle3.engine.config.speculative_config.model, (2, 4, 5))
    ids = torch.arange(5, 25)  # a prompt not cached yet: the target computes all of it
    runner = eagle3.engine.runner
    got = {}
    tap = runner.hidden_tap
    runner.hidden_tap = lambda batch, aux: got.setdefault("aux", aux.clone())
    try:
        eagle3.generate([ids.tolist()], SamplingParams(temperature=0, max_tokens=1),
                        use_tqdm=False)  # fmt: skip
    finally:
        runner.hidden_tap = tap
    want = ref.aux_states(ids).detach()
    torch.testing.assert_close(got["aux"], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer_ids", [None, [0, 3, 7]])
def test_proposals_match_a_reference_forward(target, tmp_path, layer_ids):
    """vLLM's default aux layers, and the checkpoint's own (layer 0: the embedding)."""
    path = write_head(str(tmp_path), target, seed=5, layer_ids=layer_ids)
    llm = eagle3_llm(target, path, enable_prefix_caching=False)
    aux = tuple(layer_ids or (2, 4, 5))
    assert llm.engine.runner.model.aux_layers == aux
    seen = record_proposals(llm)
    generate(llm, prompts())
    assert len(seen) > 20
    ref = _Reference(target, path, aux)
    for tokens, props in seen[::3]:  # every third verification: a few seconds
        assert props == ref.propose(tokens, len(props))


def test_full_vocabulary_head_with_its_own_embedding(target, tmp_path, reference):
    """draft_vocab_size = the target's (d2t all zero: no mapping), embed_tokens in the
    checkpoint (the head's own, not the target's)."""
    path = write_head(str(tmp_path), target, seed=6, draft_vocab=V, own_embed=True)
    llm = eagle3_llm(target, path, enable_prefix_caching=False)
    head = llm.engine.spec.draft.runner.model
    assert head.draft_to_target is None and head.embed_tokens is not None
    seen = record_proposals(llm)
    assert generate(llm, prompts()) == reference
    ref = _Reference(target, path, (2, 4, 5))
    assert seen and all(props == ref.propose(t, len(props)) for t, props in seen[:20])


def test_sampling(eagle3, target, head):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=12,
                            ignore_eos=True, n=2)  # fmt: skip
    spec = eagle3.engine.spec
    propose, qs = spec.draft.propose, []

    def wrapped(batch, items):
        out = propose(batch, items)
        qs.extend(q for rows in spec.draft.probs.values() for q in rows)
        return out

    spec.draft.propose = wrapped
    try:
        outs = eagle3.generate(prompts()[1:3], params, use_tqdm=False)
    finally:
        spec.draft.propose = propose
    tokens = [c.token_ids for o in outs for c in o.outputs]
    assert all(len(t) == 12 and all(0 <= x < V for x in t) for t in tokens)
    plain = LLM(target, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32)
    outs = plain.generate(prompts()[1:3], params, use_tqdm=False)
    assert tokens == [c.token_ids for o in outs for c in o.outputs]  # seeded: plain's draws
    assert qs  # the head's distributions, over the target's vocabulary
    outside = sorted(set(range(V)) - draft_ids(head))
    for q in qs:
        assert q.shape == (V,) and float(q[outside].abs().max()) == 0.0
        assert abs(float(q.sum()) - 1) < 1e-4
    assert eagle3.engine.kv.num_free_blocks == eagle3.engine.num_blocks


EAGLE3 = {"method": "eagle3", "model": "x", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
        ({**EAGLE3, "prompt_lookup_min": 1}, "prompt_lookup_min"),
        ({**EAGLE3, "method": "mtp"}, "method"),
    ],
)
def test_refusals_name_the_key(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_refused_with_parallelism(parallel):
    with pytest.raises(ValueError, match="EAGLE head needs tensor_parallel_size"):
        EngineConfig(speculative_config=EAGLE3, **parallel)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 32}, "the EAGLE head's hidden_size \\(32\\) is not the target's"),
        ({"target_hidden_size": 32}, "the EAGLE head's target_hidden_size"),
        ({"vocab_size": 512}, "the EAGLE head's vocab_size"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, "reads target layers \\[2, 4, 8\\]"),
        ({"draft_vocab_size": 400}, "draft_vocab_size \\(400\\) exceeds"),
    ],
)
def test_a_head_that_does_not_fit_is_refused(target, tmp_path, change, message):
    path = write_head(str(tmp_path), target, seed=7)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        eagle3_llm(target, path)


def test_an_eagle3_head_under_method_eagle_is_refused(target, head):
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    with pytest.raises(ValueError, match="EAGLE-3 head .* use method 'eagle3'"):
        LLM(target, dtype="float32", num_kv_blocks=96, speculative_config=spec)


def test_a_draft_vocabulary_without_d2t_is_refused(target, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_head(str(tmp_path), target, seed=8)
    file = os.path.join(path, "model.safetensors")
    save_file({k: v for k, v in load_file(file).items() if k != "d2t"}, file)
    with pytest.raises(ValueError, match="needs d2t"):
        eagle3_llm(target, path)


def test_a_non_llama_target_is_refused(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=D,
                       vocab_size=V, max_position_embeddings=512, sliding_window=8)  # fmt: skip
    gemma = str(tmp_path / "gemma")
    Gemma2ForCausalLM(cfg).save_pretrained(gemma, safe_serialization=True)
    head = write_head(str(tmp_path / "head"), save_llama(str(tmp_path / "llama")), seed=9)
    with pytest.raises(ValueError, match="eagle3 needs a Llama-family target"):
        eagle3_llm(gemma, head)
