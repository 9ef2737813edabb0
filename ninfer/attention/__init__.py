"""Attention over the paged KV pool: the contract (base.py), the CPU reference backend
(reference.py), the kernel backend (triton_backend.py) and the startup choice of which
implementation serves each op (selector.py)."""
