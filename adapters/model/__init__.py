"""A local checkpoint, loaded: offline loading and the facts about a loaded model
(:mod:`.loading`), the converted copy of a GGUF checkpoint (:mod:`.gguf_cache`) and the
folder vLLM loads (:mod:`.vllm_folder`).

May import: ``abstain_guard.adapters.capture``, ``abstain_guard.errors``.
"""
