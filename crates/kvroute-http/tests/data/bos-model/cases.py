"""Writes cases.json: the ids Hugging Face's `tokenizers` gives for texts, with and without the
post-processor's special tokens (what `encode(text, add_special_tokens=...)` returns, as vLLM
calls it). Run after gen.py: python3 cases.py (needs `pip install tokenizers`).
"""
import json

from tokenizers import Tokenizer

tok = Tokenizer.from_file("tokenizer.json")
texts = [
    "Once upon a time",
    "hello",
    " leading space",
    "ünïcödé ✓",
    "<|begin_of_text|>already there",
    "a<|eot_id|>b",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
]
cases = [{"text": t,
          "with_special": tok.encode(t, add_special_tokens=True).ids,
          "without_special": tok.encode(t, add_special_tokens=False).ids} for t in texts]
with open("cases.json", "w") as f:
    f.write('{"cases": [\n')
    f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
    f.write("\n]}\n")
