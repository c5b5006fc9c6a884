"""The ``dllm-kvq`` console command: one entry point above the server, calibration and evaluation packages."""
