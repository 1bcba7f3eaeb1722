"""Step rules on numpy vectors, as pure functions: they take a gradient of a loss to *minimise*
and return the step to *add* to the parameters, plus the new rule state.

Both follow ``openai/evolution-strategies-starter`` (``es_distributed/optimizers.py``): Adam folds
the bias corrections into the step size; SGD's momentum is an exponential average of gradients
(``v = momentum * v + (1 - momentum) * g``), so ``momentum=0`` is plain SGD.
"""

from __future__ import annotations

import numpy as np


def adam_step(
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    t: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One Adam step; ``t`` is the 1-based count of steps including this one.

    >>> step, m, v = adam_step(np.array([2.0, -1.0]), np.zeros(2), np.zeros(2), 1,
    ...                        lr=0.1, beta1=0.9, beta2=0.999, epsilon=0.0)
    >>> np.round(step, 12).tolist()  # first step: -lr * sign(grad)
    [-0.1, 0.1]
    """
    m = beta1 * m + (1.0 - beta1) * grad
    v = beta2 * v + (1.0 - beta2) * grad * grad
    step_size = lr * np.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
    return -step_size * m / (np.sqrt(v) + epsilon), m, v


def sgd_step(
    grad: np.ndarray, velocity: np.ndarray, *, lr: float, momentum: float
) -> tuple[np.ndarray, np.ndarray]:
    """One SGD step with momentum as an exponential average of gradients.

    >>> step, velocity = sgd_step(np.array([2.0, -1.0]), np.zeros(2), lr=0.5, momentum=0.0)
    >>> step.tolist()
    [-1.0, 0.5]
    """
    velocity = momentum * velocity + (1.0 - momentum) * grad
    return -lr * velocity, velocity
