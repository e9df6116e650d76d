"""oppo: PPO-based RLHF for Hugging Face causal language models, with overlapped stages."""

__version__ = "0.1.0"
