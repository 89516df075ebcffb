"""The HTTP modules' shared server (tests/disagg/http_server.py), registered here so that
one test process builds it once for all of them."""

from tests.disagg.http_server import server  # noqa: F401 (a fixture, found by its name)
