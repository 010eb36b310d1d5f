"""Training: `run.run_train` (``dali-fast train``), the model and its step (`trainer`), checkpoints, the
process group, the utilization monitor."""
