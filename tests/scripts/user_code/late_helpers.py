"""A helper module of the user's, imported by late.py after ``import procpipe`` (the zygote,
forked at ``import procpipe``, never saw it): workers import it by name."""

import numpy as np


class Augment:
    def __init__(self, amount):
        self.amount = amount

    def __call__(self, x):
        return np.asarray(x) + self.amount
