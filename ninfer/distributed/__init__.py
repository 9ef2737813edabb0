"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPU): one process per rank."""
