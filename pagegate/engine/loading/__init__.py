"""Loading a model: Hugging Face folders and GGUF files into one layout, their tokenizers, token bounds."""
