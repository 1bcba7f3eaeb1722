"""The ES toolkit below the ESSA recipe: the budget plan, the start point, one generation's
fitness, the optimizer over the SVD adapter's singular values."""
