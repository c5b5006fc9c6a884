"""lm-eval integration and the paper's result matrix (``python -m evaluation``; README "Evaluate with lm-eval").

- `evaluation.lm`: the in-process lm-eval model ``dllm-kvq`` (engine directly; model_args in
  `evaluation.model_args`, likelihoods in `evaluation.likelihood`, policies and states in `evaluation.artifacts`).
- `evaluation.tasks`, `evaluation.embedded_task`: offline task YAMLs (gsm8k_local, humaneval_local, digit_ledger).
- `evaluation.protocol`: the paper's protocol preset.
- `evaluation.matrix`: the result matrix (Tables 1-2), `evaluation.calibration_table` (Table 4),
  `evaluation.card` (the table in a model card), `evaluation.scores` (accuracy telemetry).
- `evaluation.cli`: the command line.

Imports `service.engine`, `service.artifacts`, `service.quant` and `service.store`, never `service.api`.
"""
