"""A small MCP server for tests/test_act.py (the official SDK's MCPServer, once FastMCP):
run as `python mcp_server.py` for stdio or `python mcp_server.py http PORT` for streamable HTTP."""
import sys
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("hearth-test")


@server.tool()
def lookup(key: Literal["a", "b"]) -> str:  # an enum keeps the tiny model's forced call short
    """Look a key up in the test table."""
    return {"a": "apple", "b": "banana"}.get(key, f"no entry {key}")


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ToolError(f"failed on purpose: {reason}")  # isError, its message shown


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
