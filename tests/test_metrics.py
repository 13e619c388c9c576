"""The Prometheus text of a metrics registry."""

import re

from waltz.metrics import Registry

#: One sample line of the Prometheus text format 0.0.4, label values escaped as the format requires.
_LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*=%s(,[a-zA-Z_][a-zA-Z0-9_]*=%s)*\})? \S+$'
                     % (_LABEL_VALUE, _LABEL_VALUE))


def test_label_values_and_help_text_are_escaped():
    # A line feed in a label value (a storage connect string) split the sample in two: the scraper rejects
    # the whole page.
    registry = Registry()
    failures = registry.counter("waltz_test_failures_total", "reads that failed\\n", ("partition", "storage"))
    failures.inc(1, 0, 'evil"\nhost\\:55280')
    lines = registry.prometheus_text().splitlines()
    samples = [line for line in lines if line and not line.startswith("#")]
    assert samples == ['waltz_test_failures_total{partition="0",storage="evil\\"\\nhost\\\\:55280"} 1']
    assert all(_SAMPLE.match(line) for line in samples)
    assert "# HELP waltz_test_failures_total reads that failed\\\\n" in lines
