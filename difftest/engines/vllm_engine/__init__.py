"""vLLM engine: the adapter (difftest's venv) and its worker (vLLM's own venv)."""
