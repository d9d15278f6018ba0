"""kvmap client library and vLLM connector."""
