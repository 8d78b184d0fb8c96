"""The job around a run: its exit policy and resume (``job``), SLURM requeueing, the console log and
Hydra's callbacks (the run guard before Hydra writes anything, the sweep report at a sweep's end)."""
