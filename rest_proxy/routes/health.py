"""GET /health (for load balancers and probes) and GET /metrics (Prometheus); both open without the key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rest_proxy.routes.deps import Detail, Engines, Mcp, Metrics

router = APIRouter()


@router.get("/health")
async def health(engines: Engines, mcp: Mcp, detail: Detail):
    """200 `{"status": "ok"}` when every engine is SERVING, else 503 `{"status": "unavailable"}`. With
    `?detail=true` from a caller holding the API key (anyone when there is none): engines and MCP servers."""
    await engines.refresh_missing()
    states = [{"target": client.target, "model": client.model_name, "serving": await client.is_serving(timeout=2.0)}
              for client in engines.clients]
    ok = all(e["serving"] for e in states)
    body = {"status": "ok" if ok else "unavailable"}
    if detail:
        body["engines"] = states
        body["mcp_servers"] = ({name: {"connected": c.client is not None, "tools": len(c.tools)}
                                for name, c in mcp.connections.items()} if mcp is not None else {})
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(metrics: Metrics):
    return metrics.render()
