from sglang.srt.models.llama_eagle3 import EntryClass  # noqa: F401 (SGLang's LlamaForCausalLMEagle3)
