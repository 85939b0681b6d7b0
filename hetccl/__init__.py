"""hetccl: collective communication for PyTorch jobs that mix GPU vendors."""
__version__ = "0.1.0"
