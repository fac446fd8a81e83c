"""Plugins that make inference engines draft from the shared corpus without editing them.

Each engine finds its plugin through its own entry-point group (SGLang: ``sglang.srt.plugins``,
vLLM: ``vllm.general_plugins``, both registered by this distribution). Every plugin reads the same
environment (``settings.IntegrationSettings``) and is inert when ``NGRAM_CORPUS_TARGET`` is unset.
Nothing here imports an engine at module level: the base install never pulls one in."""
