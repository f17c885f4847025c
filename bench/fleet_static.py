"""The plain static file server bench/fleet_rollout.py measures the control plane's artifact
downloads against, and the mirror its devices use with ``--downloads mirror``: Starlette's
StaticFiles (HTTP Range, ETag) on uvicorn, the same server stack as `cascade fleet serve` without
our app, serving the registry's artifacts and TUF metadata folders under the same URLs
(``/v1/artifacts/{sha256}``, ``/v1/tuf/{file}``), no credentials.

    FLEET_STATIC_ARTIFACTS=<fleet>/artifacts/sha256 FLEET_STATIC_TUF=<fleet>/tuf \
        python -m uvicorn fleet_static:app --app-dir bench --port P
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

app = Starlette(routes=[Mount("/v1/artifacts", StaticFiles(directory=os.environ["FLEET_STATIC_ARTIFACTS"])),
                        Mount("/v1/tuf", StaticFiles(directory=os.environ["FLEET_STATIC_TUF"]))])
