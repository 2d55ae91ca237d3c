"""The base model: config, GGUF / HF loaders, tokenizer (entry point: ``loading.load_model``)."""
