from sglang.srt.models.llama import EntryClass  # noqa: F401 (SGLang's LlamaForCausalLM and kin)
