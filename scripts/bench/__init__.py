"""Helpers of ``scripts/benchmark.py``: the sample stream, the two training loops, FLOP counting, the GPU mode."""
