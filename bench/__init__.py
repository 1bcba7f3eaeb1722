"""Benchmarks of essa-align; `python -m bench` runs the suite (see bench/suite.py)."""
