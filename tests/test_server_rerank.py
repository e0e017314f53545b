"""`hearthlm serve` on an encoder: /v1/embeddings through the official openai client, and
/v1/rerank and /rerank in the shapes llama-server answers (Jina/Cohere: query, documents,
top_n -> results sorted best first with relevance_score; TEI: query, texts -> a list with
score), the scores equal to Session.rerank's."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_util import live_server

from hearthlm import Session

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).parent / "parity"))
from encoders import DOCS, QUERY, write  # noqa: E402


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> str:
    return str(write(tmp_path_factory.mktemp("rerank") / "bert-reranker.gguf", "bert-reranker"))


def test_rerank_and_embeddings_endpoints(reranker):
    async def direct():
        async with Session.open(reranker, weight_cache=False) as s:
            return await s.rerank(QUERY, DOCS), await s.embed(DOCS)
    want, want_e = asyncio.run(direct())
    with live_server(f"rr={reranker}") as url:
        r = httpx.post(url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3,
                                                 "return_documents": True}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        order = list(np.argsort(-np.array(want), kind="stable")[:3])
        assert [x["index"] for x in body["results"]] == order
        assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-5 for x in body["results"])
        assert body["results"][0]["document"]["text"] == DOCS[order[0]] and body["usage"]["prompt_tokens"] > 0
        tei = httpx.post(url + "/rerank", json={"query": QUERY, "texts": DOCS}, timeout=60).json()
        assert sorted(x["index"] for x in tei) == [0, 1, 2, 3] and "score" in tei[0]
        bad = httpx.post(url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": []}, timeout=60)
        assert bad.status_code == 400 and "documents" in bad.text
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        e = c.embeddings.create(model="rr", input=DOCS)
        assert np.allclose([d.embedding for d in e.data], want_e, atol=1e-5)
        with pytest.raises(openai.BadRequestError, match="encoder"):
            c.completions.create(model="rr", prompt="the hearth", max_tokens=4)
