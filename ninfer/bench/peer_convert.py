"""llama.cpp's convert_hf_to_gguf.py run in-process, with two declared departures from a plain run:

* No `tokenizer.model` in the checkpoint: the converter's SentencePiece attempt is skipped, as it would be
  with sentencepiece installed (it raises FileNotFoundError for a missing file and the converter falls back to
  the HF tokenizer); without the package it would stop at the import instead.
* `--pre NAME`: the GGUF's tokenizer.ggml.pre is NAME instead of the one the converter looks up by hashing
  how the tokenizer splits a test string. For tokenizers llama.cpp has no pre-tokenizer for (random
  checkpoints carry the probe model's custom split), where only token ids matter: `ninfer bench peer`
  feeds ids to both engines (speed) or has ninfer score the ids llama-perplexity tokenized (KL).

    python -m ninfer.bench.peer_convert LLAMA_SRC [--pre NAME] -- MODEL_DIR --outfile F --outtype bf16
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if "--" not in argv or not argv[0] or argv[0].startswith("-"):
        print("usage: python -m ninfer.bench.peer_convert LLAMA_SRC [--pre NAME] -- CONVERTER_ARGS", file=sys.stderr)
        return 2
    split = argv.index("--")
    own, conv = argv[:split], argv[split + 1:]
    src = Path(own[0])
    pre = own[own.index("--pre") + 1] if "--pre" in own else None
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion import base  # llama.cpp's converter package

    model_dir = Path(conv[0])
    if not (model_dir / "tokenizer.model").is_file():
        def no_sentencepiece(self, *a, **k):
            raise FileNotFoundError(f"no tokenizer.model in {model_dir}")
        base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    if pre is not None:
        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *conv]
    import convert_hf_to_gguf
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
