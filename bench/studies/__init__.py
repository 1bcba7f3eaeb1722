"""Studies: each trains whole runs, minutes to hours, and compares held-out accuracy paired on the
same items; written up in docs/results*.md. What every study repeats is bench/studies/common.py."""
