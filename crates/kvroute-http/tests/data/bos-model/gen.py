"""Writes tokenizer.json and tokenizer_config.json of the BOS test model.

Shaped like the tokenizer of `make_tiny_tokenizer.py` that real vLLM runs were made with (a
Llama-3-style model directory): its `tokenizer.json` post-processor ADDS BOS around a single
sequence, its chat template starts with `{{ bos_token }}`, and its `tokenizer_config.json` says
`"add_bos_token": false`, which `tokenizer.json` overrides in Hugging Face's fast tokenizers (and
so in vLLM): a text completion gets BOS, a chat prompt gets the template's one BOS.

The model is a byte-level BPE with no merges (one token per byte, ids 0-255, GPT-2's
byte-to-unicode alphabet) plus five special tokens, so token counts are easy to reason about
and the file is a few kilobytes.
Run: python3 gen.py (no third-party package needed); then `python3 cases.py` (needs Hugging
Face's `tokenizers`) writes `cases.json`, the reference ids the Rust tests compare with.
"""
import json


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BOS = "<|begin_of_text|>"
alphabet = bytes_to_unicode()
vocab = {alphabet[b]: b for b in range(256)}
specials = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
added = []
for i, tok in enumerate(specials):
    vocab[tok] = 256 + i
    added.append({"id": 256 + i, "content": tok, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True})


def special(type_id):
    return {"SpecialToken": {"id": BOS, "type_id": type_id}}


def sequence(name, type_id):
    return {"Sequence": {"id": name, "type_id": type_id}}


tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": added,
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    # What `processors.TemplateProcessing(single="<|begin_of_text|> $A", ...)` writes.
    "post_processor": {
        "type": "TemplateProcessing",
        "single": [special(0), sequence("A", 0)],
        "pair": [special(0), sequence("A", 0), special(1), sequence("B", 1)],
        "special_tokens": {BOS: {"id": BOS, "ids": [256], "tokens": [BOS]}},
    },
    "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "ignore_merges": False, "vocab": vocab, "merges": []},
}
# make_tiny_tokenizer.py's template, as vLLM renders it.
template = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS,
    "eos_token": "<|eot_id|>",
    "model_max_length": 8192,
    "chat_template": template,
    "add_bos_token": False,
}
with open("tokenizer.json", "w") as f:
    json.dump(tokenizer, f, ensure_ascii=False, separators=(",", ":"))
    f.write("\n")
with open("tokenizer_config.json", "w") as f:
    json.dump(config, f, ensure_ascii=False, indent=1)
    f.write("\n")
