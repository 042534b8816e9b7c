"""tunegate's benchmarks: every figure is a pair or a ratio measured side by side in the same run.

`python -m bench [NAME ...] [--quick]` runs the named benches (all of them by default), writes a JSON report
under `bench/results/` and a markdown summary to `BENCHMARKS.md`. See `bench.registry` for the names.
"""
