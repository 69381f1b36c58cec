"""Model loading (GGUF and Hugging Face folders), tokenizer and chat template, and the decoder."""
