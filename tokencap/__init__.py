"""tokencap: token-budgeted LLM data generation over Redis queues."""

__version__ = "0.1.0"
