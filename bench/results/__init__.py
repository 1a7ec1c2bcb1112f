"""Results: the record a run writes (per-rank results merged), the collection of records into rows and
cells for the report, and the table printed after a run."""
