"""Inference engines headway drives in another Python environment (vLLM: ``vllm_client`` here,
``vllm_worker`` there). Standard library only on this side: the engines pin their own torch and
transformers, so they never share headway's environment; jobs and results travel as JSON files."""
