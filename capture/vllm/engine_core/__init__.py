"""What the vLLM plugin runs in vLLM's engine-core process: the scheduler hook (`scheduler.py`)."""
