"""Benchmarks (bench/benchmarks/) and studies (bench/studies/) of essa-align; `python -m bench`
runs the benchmark suite (see bench/suite.py), `python -m bench --list` names every driver."""
