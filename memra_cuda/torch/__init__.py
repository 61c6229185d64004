"""memra_cuda inside a PyTorch engine (optional: needs `torch`)."""
from .adapter import *  # noqa: F401,F403
