from difftest.engines.sglang_engine.adapter import SGLangAdapter

__all__ = ["SGLangAdapter"]
