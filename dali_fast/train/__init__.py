"""Training: ``run`` (`run_train`, ``dali-fast train``, in named phases) with its settings (``config``), the
sets it trains and evaluates on (``sets``), the lines it prints (``lines``), the model and its step
(``trainer``, ``models``), held-out metrics (``metrics``), checkpoints and the audit trail
(``checkpoint``), the process group (``distributed``) and the utilization monitor (``monitor``)."""
