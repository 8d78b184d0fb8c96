"""What a run records and where: the run directory's file names (``layout``), the metric keys, the
tensor store, the CSV log, the status file, W&B's offline records and whether W&B is reachable.
No Lightning callbacks and no drawing here: these modules write and read files."""
