"""The shared contract of cascade's deployables and its decisions: the OpenAI wire types and
generation events, errors, stops and chat templates, configuration, the cascade's policies
(pure functions, ``cascade.policy``), the HTTP shell every server shares (``cascade.web``),
evaluation tools (``cascade.eval``) and child-process helpers. It imports no deployable."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cascade-serve")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
