"""Training: `run.run_train` (``dali-fast train``, in named phases), its settings (`config`), the sets it trains
and evaluates on (`sets`), the lines it prints (`lines`), the model and its step (`trainer`, `models`,
`metrics`), checkpoints, the process group (`distributed`), the utilization monitor."""
