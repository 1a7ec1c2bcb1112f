"""`python -m bench.report DIR`: tables, plots, decision tree and claims check from a sweep's records."""
