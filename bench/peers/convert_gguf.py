"""Run llama.cpp's `convert_hf_to_gguf.py` unchanged, answering what it cannot work out for a byte-level BPE folder.

    python bench/peers/convert_gguf.py LLAMA_CPP_DIR PRE_NAME MODEL_DIR [converter options...]

The converter names a BPE pre-tokenizer by hashing the tokenizer's output on a test string, and knows only
published models' hashes; PRE_NAME ("gpt-2", say, or "" to keep the lookup) is the answer it gets instead. Its Llama
vocabulary path also imports sentencepiece before it looks for a `tokenizer.model`: a folder without one skips
that step here, so sentencepiece is not needed.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    source, pre, model_dir, *options = sys.argv[1:]
    sys.path.insert(0, source)
    sys.argv = ["convert_hf_to_gguf.py", model_dir, *options]
    import conversion  # the converter's own package; importing the script puts its gguf-py first on the path
    import convert_hf_to_gguf

    if pre:
        conversion.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    if not (Path(model_dir) / "tokenizer.model").is_file():
        def no_sentencepiece(self) -> None:
            raise FileNotFoundError("no tokenizer.model")  # the converter then tries the BPE vocabularies
        conversion.TextModel._set_vocab_sentencepiece = no_sentencepiece
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
