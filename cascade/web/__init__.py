"""HTTP glue shared by our OpenAI-compatible servers (edge agent, cloud worker, gateway):
the app shell (``app``), reading requests (``requests``), answering from generation events
(``responses``), and the tier header every response carries (``tier_header``)."""

from cascade.web.app import RequestRoute, build_openai_app
from cascade.web.requests import parse_body, read_json, require_api_key
from cascade.web.responses import openai_response

__all__ = ["RequestRoute", "build_openai_app", "openai_response", "parse_body", "read_json", "require_api_key"]
