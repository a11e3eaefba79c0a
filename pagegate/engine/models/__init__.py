"""Model families, one file each (llama.py, ...), their shared layers, and the registry that picks one."""
