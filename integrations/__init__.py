"""Framework adapters, installed as ``hetccl.integrations`` (see pyproject's wheel.packages).

Each adapter imports its framework lazily and raises a clear ImportError naming the extra to
install (``pip install hetccl[deepspeed]``, ``[transformers]``, ``[megatron]``) when it is absent.
"""
