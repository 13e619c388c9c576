"""The HTTP endpoints every Waltz daemon serves: ``/ping``, ``/health`` and ``/metrics``.

``/health`` answers 200 ``healthy`` or 503 with one line per problem, from a
callable that returns the list of current problems (empty when healthy).
``/metrics`` is the Prometheus text format of a :class:`~waltz.metrics.Registry`.
"""

from twisted.web.resource import Resource
from twisted.web.server import Site

PROMETHEUS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class _QuietSite(Site):
    """A Site that does not log every request (health checks would flood the daemon's log)."""

    def log(self, request):
        pass


class _Leaf(Resource):
    isLeaf = True

    def __init__(self, render_text):
        super().__init__()
        self._render_text = render_text

    def render_GET(self, request):
        status, content_type, body = self._render_text()
        request.setResponseCode(status)
        request.setHeader(b"content-type", content_type)
        return body.encode("utf-8")


def health_site(registry, problems, name="waltz"):
    """A :class:`Site` serving ``/ping``, ``/health`` (from ``problems()``) and ``/metrics``."""

    def ping():
        return 200, b"text/plain; charset=utf-8", "pong\n"

    def health():
        found = list(problems())
        if found:
            return 503, b"text/plain; charset=utf-8", "unhealthy\n" + "".join("%s\n" % p for p in found)
        return 200, b"text/plain; charset=utf-8", "healthy\n"

    def metrics():
        return 200, PROMETHEUS_CONTENT_TYPE, registry.prometheus_text()

    root = Resource()
    root.putChild(b"ping", _Leaf(ping))
    root.putChild(b"health", _Leaf(health))
    root.putChild(b"metrics", _Leaf(metrics))
    site = _QuietSite(root)
    site.displayTracebacks = False
    site.noisy = False
    return site
