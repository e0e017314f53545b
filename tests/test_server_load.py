"""Load: 64 concurrent streaming clients against a live `hearthlm serve`, 10% of them
disconnecting midway. Every other stream completes with a finish reason, the disconnected
requests are aborted (not run to their end), and the KV blocks in use go back to 0."""
from __future__ import annotations

import asyncio
import time

import pytest

openai = pytest.importorskip("openai")

from serve_util import live_server, metrics, wait_for  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402

N_CLIENTS, N_DROP = 64, 7        # 7 of 64: about 10% go away
MAX_TOKENS, DROP_MAX_TOKENS = 24, 400  # the leavers ask for many: were they not aborted, they would still run


def test_64_streams_with_disconnects(tmp_path):
    tiny = str(write_tiny(tmp_path / "tiny.gguf"))
    with live_server(f"tiny={tiny}", "--n-ctx", "512", "--max-seqs", "64") as url:
        async def client(i: int):
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            leaver = i % (N_CLIENTS // N_DROP) == 0 and i // (N_CLIENTS // N_DROP) < N_DROP
            stream = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"client {i} says hello"}], stream=True,
                max_tokens=DROP_MAX_TOKENS if leaver else MAX_TOKENS, temperature=0)
            n, reason = 0, None
            async for ch in stream:
                n += 1
                if leaver and n == 3:
                    await stream.close()  # the connection goes: the server must abort the request
                    break
                reason = ch.choices[0].finish_reason or reason
            await c.close()
            return leaver, n, reason
        async def everyone():
            return await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(N_CLIENTS))), 300)
        t0 = time.monotonic()
        results = asyncio.run(everyone())
        elapsed = time.monotonic() - t0
        leavers = [r for r in results if r[0]]
        stayers = [r for r in results if not r[0]]
        assert len(leavers) == N_DROP
        assert all(reason in ("stop", "length") for _, _, reason in stayers), stayers
        assert wait_for(lambda: metrics(url)["hearthlm_running_requests"] == 0, timeout=20)
        m = metrics(url)
        print(f"\nload: {len(stayers)}/{len(stayers)} streams completed, {N_DROP} disconnected, "
              f"{elapsed:.1f} s, {m['hearthlm_generated_tokens_total']:.0f} tokens, "
              f"KV blocks in use after: {m['hearthlm_kv_blocks_used']:.0f}")
        assert m["hearthlm_kv_blocks_used"] == 0 and m["hearthlm_queue_depth"] == 0
        # the leavers were cut short: all tokens together stay far below their 400 each
        assert m["hearthlm_generated_tokens_total"] < len(stayers) * MAX_TOKENS + N_DROP * DROP_MAX_TOKENS / 2
        assert m["hearthlm_streams_total"] == N_CLIENTS
