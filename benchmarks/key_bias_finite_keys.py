"""How much of the key-bias correction's predicted inflation a softmax over finitely many keys realizes.

The correction (`service.quant.key_bias`) subtracts ``log E[exp(n)]`` from every quantized key's score, ``n`` the
score's rounding noise: what makes the *expected* softmax mass of the quantized keys exact. For Gaussian noise of
variance ``s2`` that is ``s2 / 2``. A softmax realizes ``log mean_j exp(n_j)`` over the keys that share its mass; the
mean of that is ``s2 / 2`` only when those keys are many against ``exp(s2)`` (the expectation is carried by rare
large ``n``), and falls well below it when ``s2`` is large and the keys few. This prints, for equal-weight keys, the
predicted ``s2 / 2`` against the mean realized log-mean-exp over 2,000 draws (float64, seed 0).

``s2 = 12.8`` is the variance whose ``s2 / 2`` is the 6.4 nats per key the exact form removes at 2 bits on the
embedded model (docs/quantization.md); ``s2 = 0.5`` is about a 4-bit step's.

Usage: ``python benchmarks/key_bias_finite_keys.py``.
"""

from __future__ import annotations

import math

import torch


def realized(s2: float, keys: int, draws: int = 2000, seed: int = 0) -> float:
    """Mean over ``draws`` of ``log mean_j exp(n_j)``, ``n_j`` iid normal of variance ``s2``, ``keys`` of them."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.randn(draws, keys, generator=gen, dtype=torch.float64) * math.sqrt(s2)
    return (torch.logsumexp(n, 1) - math.log(keys)).mean().item()


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'s2':>6}{'keys':>7}{'predicted s2/2':>16}{'realized':>10}")
    for s2 in (0.5, 2.0, 5.0, 12.8):
        for keys in (4, 16, 256, 4096):
            print(f"{s2:>6.1f}{keys:>7}{s2 / 2:>16.2f}{realized(s2, keys):>10.2f}")


if __name__ == "__main__":
    main()
