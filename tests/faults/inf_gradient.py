"""An identity whose backward returns an inf gradient: an fp16 loss-scaled backward overflowing
while the loss itself stays finite. Shared by ``inject.py`` (run as a script beside this file, or
imported by the fault tests' forked ranks) and the engine's tests."""

import math

import torch


class InfGradient(torch.autograd.Function):
    """Identity forward; ``grad * inf`` backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.inf
