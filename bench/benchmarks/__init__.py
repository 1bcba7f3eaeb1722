"""Benchmarks: each times or sizes one thing in minutes and reports ratios measured side by side
in one run (``report_rows``, rendered into docs/performance.md by ``python -m bench``)."""
