"""llama.cpp's convert_hf_to_gguf.py for pagoda's bench models (run by `benchmarks/llama_cpp.sh gguf`).

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text, and knows only
the hashes of released models. The bench models' tokenizers are trained locally with Qwen2's split regex,
so their hash is unknown; this tells the converter "qwen2", which is what their tokenizer.json says.

    python benchmarks/gguf_convert.py <llama.cpp source dir> <convert_hf_to_gguf.py arguments...>
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def main() -> None:
    source, arguments = Path(sys.argv[1]), sys.argv[2:]
    model_dir = Path(next(a for a in arguments if not a.startswith("-")))
    pre_tokenizer = json.dumps(json.loads((model_dir / "tokenizer.json").read_text())["pre_tokenizer"])
    if json.dumps(QWEN2_SPLIT)[1:-1] not in pre_tokenizer:
        sys.exit(f"{model_dir}: not a bench model's tokenizer (Qwen2's split); run convert_hf_to_gguf.py directly")
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion import base  # type: ignore[import-not-found]

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *arguments]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
