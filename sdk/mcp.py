"""hearthlm.mcp: an MCP server's tools as tools for Session.act, over the official `mcp`
SDK (an optional extra: pip install 'hearthlm[mcp]'; imported only when used).

    async with hearthlm.mcp.stdio_tools(["python", "server.py"]) as tools:
        done = await session.act(messages=[...], tools=tools)

Each MCP tool's inputSchema is its schema; a result's text content is joined for the model,
and an isError result is reported to it as an error."""
from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from hearthlm.act import Tool, ToolError
from hearthlm.core.errors import InvalidRequestError


def _sdk():
    try:
        import mcp
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client
    except ImportError as e:
        raise ImportError("hearthlm.mcp needs the official MCP SDK (mcp>=2): pip install 'hearthlm[mcp]'") from e
    return mcp, stdio_client, streamable_http_client, create_mcp_http_client


@asynccontextmanager
async def stdio_tools(command: Sequence[str], env: dict[str, str] | None = None,
                      cwd: str | None = None) -> AsyncIterator[list[Tool]]:
    """The tools of an MCP server run as a subprocess (`command`: the program and its
    arguments) speaking over stdin/stdout; the process ends when the block does. `env`:
    variables over the SDK's default environment."""
    mcp, stdio_client, _, _ = _sdk()
    if isinstance(command, str) or not command or not all(isinstance(a, str) for a in command):
        raise InvalidRequestError(f"stdio_tools takes [command, *args] as strings, got {command!r}")
    params = mcp.StdioServerParameters(command=command[0], args=list(command[1:]), env=env, cwd=cwd)
    async with stdio_client(params) as (read, write), mcp.ClientSession(read, write) as session:
        await session.initialize()
        yield await list_tools(session)


@asynccontextmanager
async def http_tools(url: str, headers: dict[str, str] | None = None) -> AsyncIterator[list[Tool]]:
    """The tools of an MCP server at `url` (streamable HTTP); `headers` go with every request
    (e.g. {"Authorization": "Bearer ..."})."""
    mcp, _, streamable_http_client, create_client = _sdk()
    async with create_client(headers=headers) as client, \
            streamable_http_client(url, http_client=client) as (read, write), \
            mcp.ClientSession(read, write) as session:
        await session.initialize()
        yield await list_tools(session)


async def list_tools(session: Any) -> list[Tool]:
    """An initialized mcp.ClientSession's tools (every page) as Tools that call it."""
    from mcp.types import PaginatedRequestParams
    tools, cursor = [], None
    while True:
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += [mcp_tool(session, t) for t in page.tools]
        cursor = page.next_cursor
        if not cursor:
            return tools


def mcp_tool(session: Any, t: Any) -> Tool:
    spec = {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                             "parameters": t.input_schema or {"type": "object", "properties": {}}}}

    async def call(**args: Any) -> str:
        r = await session.call_tool(t.name, args)
        text = "\n".join(c.text if c.type == "text" else f"[{c.type} content]" for c in r.content)
        if not text and r.structured_content is not None:
            text = json.dumps(r.structured_content, ensure_ascii=False)
        if r.is_error:
            raise ToolError(text or f"the MCP tool {t.name} failed")
        return text
    return Tool(spec, call)
