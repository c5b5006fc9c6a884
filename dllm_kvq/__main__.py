"""``python -m dllm_kvq <command> ...``: the same as the installed ``dllm-kvq`` command (`dllm_kvq.cli`)."""

from dllm_kvq.cli import main

raise SystemExit(main())
