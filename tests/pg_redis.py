"""Real PostgreSQL and Redis servers for the tests, started once per session (the fixtures
``postgres_dsn`` and ``redis_url`` in tests/conftest.py). The servers themselves are
``testkit.devservers`` (the benchmarks start them too, and may not import the tests). A missing
server binary is a failure naming what to install, never a skip: CI installs both (.ci/run)."""

from testkit.devservers import MissingServer, Postgres, Redis, fresh_database

__all__ = ["MissingServer", "Postgres", "Redis", "fresh_database"]
