"""Reranking, as llama-server serves it on /v1/rerank, /rerank, /v1/reranking and /reranking:
Jina's and Cohere's shape (`query`, `documents`; results with relevance_score and usage) or
TEI's (`query`, `texts`; a bare list with score). Included by the app behind the API key check."""
from __future__ import annotations

from fastapi import APIRouter, Request

from hearthlm.serve.common import host_of, until_disconnect
from hearthlm.serve.protocol import RerankRequest

router = APIRouter()
PATHS = ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")


async def rerank(body: RerankRequest, request: Request):
    """Scores sorted best first, top_n of them (llama-server's format_response_rerank)."""
    s = host_of(request).get(body.model or None)
    docs = body.docs()
    scores = await until_disconnect(request, s.rerank(body.query, docs))
    tei = body.documents is None
    key = "score" if tei else "relevance_score"
    results = [{"index": i, key: sc} for i, sc in enumerate(scores)]
    results.sort(key=lambda r: -r[key])
    results = results[:body.top_n or len(results)]
    for r in results:
        if tei and body.return_text:
            r["text"] = docs[r["index"]]
        elif not tei and body.return_documents:
            r["document"] = {"text": docs[r["index"]]}
    if tei:
        return results
    n_tokens = sum(len(s.rerank_ids(body.query, d)) for d in docs)
    return dict(model=body.model, object="list", results=results, usage=dict(prompt_tokens=n_tokens, total_tokens=n_tokens))


for _path in PATHS:
    router.add_api_route(_path, rerank, methods=["POST"])
