"""dpsgd: the randomized-clipping DP-SGD trainer in PyTorch.

Not implemented yet (tracked by the issue "dpsgd: the randomized-clipping DP-SGD trainer in
PyTorch"). The package exists so the distribution's layout is fixed; importing it does not need torch.
"""

__all__: list[str] = []
