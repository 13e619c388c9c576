"""A small metrics registry with Prometheus text exposition and a JSON snapshot.

Counters, gauges and histograms, each optionally labelled (e.g. per
partition). Metrics are updated and read on the reactor thread only (a
storage's disk threads report their work through the reactor, the HTTP and
admin endpoints run on it), so an update takes no lock: it is a dict update,
cheap enough for paths that run several times per transaction. Code running
on another thread must not update a metric; it hands the figures to the
reactor (``callFromThread``, or a Deferred that fires there).
"""

import bisect
import json

#: Latency buckets in seconds, from 100 µs to 10 s.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Size buckets for batch sizes (records per group commit, etc.).
SIZE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


def _escaped(text, quote=True):
    """``text`` as the Prometheus text format wants it: backslash and line feed escaped (and the double
    quote, in a label value); a raw line feed would split the sample and fail the whole scrape."""
    text = str(text).replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def _label_text(names, values):
    if not names:
        return ""
    return "{%s}" % ",".join('%s="%s"' % (n, _escaped(v)) for n, v in zip(names, values))


class _Metric:
    kind = None

    def __init__(self, name, doc, labels=()):
        self.name = name
        self.doc = doc
        self.label_names = tuple(labels)
        self._values = {}

    def _key(self, labels):
        if len(labels) != len(self.label_names):
            raise ValueError("%s takes labels %s" % (self.name, self.label_names))
        return tuple(labels)

    def remove(self, *labels):
        """Forget one label combination (e.g. a partition that was removed)."""
        self._values.pop(self._key(labels), None)

    def header(self):
        return ["# HELP %s %s" % (self.name, _escaped(self.doc, quote=False)), "# TYPE %s %s" % (self.name, self.kind)]


class Counter(_Metric):
    """A value that only goes up."""

    kind = "counter"

    def inc(self, amount=1, *labels):
        # (The label check of _key, inlined: counters are updated several times per transaction.)
        if len(labels) != len(self.label_names):
            self._key(labels)
        values = self._values
        values[labels] = values.get(labels, 0) + amount

    def value(self, *labels):
        return self._values.get(self._key(labels), 0)

    def lines(self):
        return ["%s%s %s" % (self.name, _label_text(self.label_names, k), v)
                for k, v in sorted(self._values.items())]

    def snapshot(self):
        return {_label_text(self.label_names, k) or "": v for k, v in self._values.items()}


class Gauge(Counter):
    """A value that goes up and down, or is computed when read."""

    kind = "gauge"

    def __init__(self, name, doc, labels=(), function=None):
        super().__init__(name, doc, labels)
        self._function = function

    def set(self, value, *labels):
        if len(labels) != len(self.label_names):
            self._key(labels)
        self._values[labels] = value

    def lines(self):
        if self._function is not None:
            return ["%s %s" % (self.name, self._function())]
        return super().lines()

    def snapshot(self):
        if self._function is not None:
            return {"": self._function()}
        return super().snapshot()


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name, doc, labels=(), buckets=LATENCY_BUCKETS):
        super().__init__(name, doc, labels)
        self.buckets = tuple(buckets)

    def observe(self, value, *labels):
        if len(labels) != len(self.label_names):
            self._key(labels)
        entry = self._values.get(labels)
        if entry is None:
            entry = self._values[labels] = [[0] * (len(self.buckets) + 1), 0.0, 0]
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1] += value
        entry[2] += 1

    def count(self, *labels):
        entry = self._values.get(self._key(labels))
        return entry[2] if entry else 0

    def lines(self):
        out = []
        for key, (counts, total, n) in sorted(self._values.items()):
            running = 0
            for bound, c in zip(self.buckets + (float("inf"),), counts):
                running += c
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append("%s_bucket%s %d" % (self.name, _label_text(self.label_names + ("le",), key + (le,)),
                                                running))
            labels = _label_text(self.label_names, key)
            out.append("%s_sum%s %s" % (self.name, labels, total))
            out.append("%s_count%s %d" % (self.name, labels, n))
        return out

    def snapshot(self):
        return {_label_text(self.label_names, k) or "": {"count": n, "sum": total}
                for k, (counts, total, n) in self._values.items()}


class Registry:
    """A named set of metrics, exposed as Prometheus text or JSON."""

    def __init__(self):
        self._metrics = {}

    def _add(self, metric):
        if metric.name in self._metrics:
            raise ValueError("metric %s registered twice" % metric.name)
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name, doc, labels=()):
        return self._add(Counter(name, doc, labels))

    def gauge(self, name, doc, labels=(), function=None):
        return self._add(Gauge(name, doc, labels, function))

    def histogram(self, name, doc, labels=(), buckets=LATENCY_BUCKETS):
        return self._add(Histogram(name, doc, labels, buckets))

    def get(self, name):
        return self._metrics[name]

    def prometheus_text(self) -> str:
        lines = []
        for metric in self._metrics.values():
            lines.extend(metric.header())
            lines.extend(metric.lines())
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps({name: m.snapshot() for name, m in self._metrics.items()}, sort_keys=True)
