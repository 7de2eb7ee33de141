"""A small real MCP server (MCPServer, the SDK's FastMCP successor) with typed tools for the harvest tests.

Tools: typed parameters (-> inputSchema), a dotted name, an overlong name, annotations, a structured output.
"""

from __future__ import annotations

from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from pydantic import BaseModel

server = MCPServer("weather")

LONG_NAME = "fetch_the_complete_hourly_weather_forecast_for_a_city_over_the_next_fourteen_days_in_detail"


class Forecast(BaseModel):
    """A forecast result (gives the tool an outputSchema)."""

    city: str
    celsius: float


@server.tool(
    title="Current weather",
    description="Current temperature of a city.",
    annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=True),
)
def get_weather(city: str, units: Literal["c", "f"] = "c", days: int = 1) -> Forecast:
    return Forecast(city=city, celsius=20.0)


@server.tool(name="weather.alerts", description="Severe weather alerts for a region.")
def alerts(region: str, severities: list[str] | None = None) -> str:
    return f"no alerts for {region}"


@server.tool(name=LONG_NAME, description="A tool whose name is longer than 64 characters.")
def long_forecast(city: str) -> str:
    return city


@server.tool(
    description="Delete the cached forecasts.",
    annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False),
)
def search(query: str, limit: int = 10) -> list[str]:
    return [query][:limit]


if __name__ == "__main__":
    server.run()
