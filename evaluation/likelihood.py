"""The Monte-Carlo masked ELBO of a continuation (the LLaDA authors' estimate), used by the in-process lm-eval model.

The estimator lives in `service.engine.likelihood`, so that the server's echo + logprobs completions
(`service.api.serving`) compute exactly the numbers lm-eval's in-process model does; see there for the method.
"""

from service.engine.likelihood import LogitsFn, greedy_check, mc_loglikelihood, request_generator

__all__ = ["LogitsFn", "greedy_check", "mc_loglikelihood", "request_generator"]
