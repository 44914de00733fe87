import os

# Tests never reach a model hub; fail fast instead of hanging on a network call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
