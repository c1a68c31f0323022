"""/v1/embeddings through the openai client: floats and base64 equal HF's pooled hidden states,
dimensions honoured or refused, bad inputs are 400s naming the field; a pooling-runner model
refuses completions."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from emb_helpers import hf_pooled, prompts
from server_helpers import server_helpers

srv_conf = server_helpers()

ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def server(qwen3_embedding, tmp_path_factory):
    srv = srv_conf.start_server([qwen3_embedding, *ARGS], tmp_path_factory.mktemp("emb") / "log")
    yield srv
    srv_conf.stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def close(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), w, atol=2e-5, rtol=1e-4)


def test_token_ids_float_and_base64(client, qwen3_embedding):
    ps = prompts([7, 50], seed=6)  # 50 tokens: two chunks
    want = hf_pooled(qwen3_embedding, ps, "LAST", normalize=True)
    for fmt in ("float", "base64", None):  # None: the client asks for base64 and decodes it
        kw = {"encoding_format": fmt} if fmt else {}
        r = client.embeddings.create(model="qwen3-embedding", input=ps, **kw)
        assert [d.index for d in r.data] == [0, 1]
        got = [d.embedding for d in r.data]
        if fmt == "base64":  # little-endian float32, as OpenAI encodes it
            got = [np.frombuffer(base64.b64decode(g), dtype="<f4").tolist() for g in got]
        close(got, want)
        assert r.usage.prompt_tokens == r.usage.total_tokens == 57
    one = client.embeddings.create(model="qwen3-embedding", input=ps[1], user="u1")
    close([one.data[0].embedding], want[1:])


def test_text_dimensions_and_truncation(client, qwen3_embedding, server):
    from transformers import AutoTokenizer

    texts = ["the quick brown fox", "paged attention keeps blocks"]
    ids = [AutoTokenizer.from_pretrained(qwen3_embedding)(t).input_ids for t in texts]
    hidden = hf_pooled(qwen3_embedding, ids, "LAST", normalize=False)
    r = client.embeddings.create(model="qwen3-embedding", input=texts, dimensions=16,
                                 encoding_format="float")  # fmt: skip
    close(
        [d.embedding for d in r.data],
        [torch.nn.functional.normalize(h[:16], dim=-1) for h in hidden],
    )
    body = {"input": [ids[0] * 30], "truncate_prompt_tokens": 20, "normalize": False}
    got = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60).json()
    close(
        [got["data"][0]["embedding"]],
        hf_pooled(qwen3_embedding, [(ids[0] * 30)[-20:]], "LAST", False),
    )
    assert got["usage"]["prompt_tokens"] == 20


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [5] * 300}, "input"),  # longer than max_model_len (256)
        ({"input": [999]}, "input"),  # out of vocabulary
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 65}, "dimensions"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
        ({"input": "hi", "temperature": 0.5}, "temperature"),  # not an embeddings field
    ],
)
def test_bad_inputs_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_generation_refused_then_still_serving(server, client):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "runs for pooling" in r.json()["error"]["message"]
    assert len(client.embeddings.create(input=[5, 6], model="qwen3-embedding").data) == 1
