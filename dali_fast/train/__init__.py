"""Training: ``run`` (`run_train`, ``dali-fast train``) with its settings (``config``), the model and its step
(``trainer``, ``models``), checkpoints and the audit trail (``checkpoint``), the process group
(``distributed``), held-out metrics (``metrics``) and the utilization monitor (``monitor``)."""
